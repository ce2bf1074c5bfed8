"""Hardening: bad input fails up front (one ``error:`` line, exit status 2, no model loaded, no runs/ folder);
the same config and seed give the same record; a misconfigured wandb cannot fail or damage a run; the record
names its provenance. Tiny random models and offline tasks only; everything in process through ``h2o.pipeline.run.main``.
"""
from __future__ import annotations

import inspect
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from h2o.store.files import read_jsonl
from h2o.tasks.summarization import clean, load_split
from tests.refusal import refusal

TINY = ["model=tiny-llama", "threads=1"]
NIAH = ["task=niah", "task.lengths=[1024]"]
HUB_OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
# bb_xsum's in-context pool on the suite's stand-ins (tests/bigbench_standins.py): train articles of 50-150 words
XSUM_POOL = sum(50 <= len(clean(r["article"], 512).split()) <= 150 for r in load_split("bb_xsum", "train"))
REASONING_DATA = Path(__file__).parent / "data" / "reasoning"  # a few problems in each data set's own fields
IS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0

# (id, args, words the one line must contain, extra environment). "{tmp}" is the test's tmp_path.
BAD = [
    ("budget-zero", [*TINY, "policy.budget=0"], ["budget=0", "> 0"], {}),
    ("budget-negative", [*TINY, "policy.budget=-0.1"], ["budget=-0.1", "(0, 1]"], {}),
    ("budget-over-one", [*TINY, "policy.budget=1.01"], ["budget=1.01", "(0, 1]"], {}),
    ("heavy-plus-recent-over-one", [*TINY, "policy.heavy=0.6", "policy.recent=0.6"], ["heavy + recent", "<= 1"], {}),
    ("streaming-budget-below-sinks", [*TINY, "policy=streaming_llm", "policy.budget=3"], ["budget=3", "sinks"], {}),
    ("streaming-sinks-over-budget", [*TINY, "policy=streaming_llm", "policy.budget=6", "policy.sinks=8"],
     ["budget=6", "sinks"], {}),
    ("unknown-model", ["model=gpt-5", "threads=1"], ["model=gpt-5", "allowed", "tiny-llama"], {}),
    ("unknown-policy", [*TINY, "policy=lru"], ["policy=lru", "allowed", "h2o"], {}),
    ("unknown-task", [*TINY, "task=bb_nope"], ["task=bb_nope", "allowed", "bb_copa"], {}),
    ("unknown-experiment", [*TINY, "experiment=table99"], ["experiment=table99", "allowed", "table1"], {}),
    ("unknown-policy-option", [*TINY, "+policy.foo=1"], ["policy.foo", "allowed", "budget"], {}),
    ("unknown-task-option", [*TINY, "+task.foo=1"], ["task.foo", "allowed", "shots"], {}),
    pytest.param("cuda-without-gpu", [*TINY, "model.device_map=cuda"], ["device_map='cuda'", "no CUDA", "allowed"], {},
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU"), id="cuda-without-gpu"),
    ("cuda-index-too-high", [*TINY, "model.device_map=cuda:7"], ["cuda:7", "allowed"], {}),
    ("shots-over-train-split", [*TINY, "task=bb_copa", "task.shots=50"], ["shots=50", "20 train", "0-20"], {}),
    ("window-over-context", [*TINY, "task=austen_ppl", "task.window=100000"], ["window=100000", "4096"], {}),
    ("offline-hub-xsum", [*TINY, "task=xsum"], ["task=xsum", "HF_DATASETS_OFFLINE", "bb_"], HUB_OFFLINE),
    ("offline-hub-copa", [*TINY, "task=copa"], ["task=copa", "HF_DATASETS_OFFLINE", "bb_"], HUB_OFFLINE),
    ("offline-hub-cnn-dm", [*TINY, "task=cnn_dm"], ["task=cnn_dm", "HF_HUB_OFFLINE"], {"HF_HUB_OFFLINE": "1"}),
    ("malformed-task-yaml", [*TINY, "task=bb_copa", "task.include_path={tmp}/badtasks"], ["include_path", "bb_copa.yaml", "YAML"], {}),
    ("runs-dir-under-a-file", [*TINY, "runs_dir={tmp}/afile/runs"], ["runs_dir=", "afile", "not a folder"], {}),
    pytest.param("runs-dir-read-only", [*TINY, "runs_dir={tmp}/ro/runs"], ["runs_dir=", "not writable"], {},
                 marks=pytest.mark.skipif(IS_ROOT, reason="root writes into a 0o555 folder (covered by the file case)"), id="runs-dir-read-only"),
    ("semantics-unknown", [*TINY, "semantics=exact"], ["semantics='exact'", "allows", "simulated"], {}),
    ("semantics-real-multiple-choice", [*TINY, "task=bb_copa", "semantics=real"], ["semantics='real'", "simulated"], {}),
    ("semantics-simulated-generation", [*TINY, "task=bb_xsum", "semantics=simulated"], ["semantics='simulated'", "real"],
     {}),
    ("seed-negative", [*TINY, "seed=-1"], ["seed=-1", "int"], {}),
    ("seed-not-int", [*TINY, "seed=abc"], ["seed='abc'", "int"], {}),
    ("threads-not-int", ["model=tiny-llama", "threads=abc"], ["threads='abc'", "positive int"], {}),
    ("threads-zero", ["model=tiny-llama", "threads=0"], ["threads=0", "positive int"], {}),
    ("limit-zero", [*TINY, "task=bb_copa", "task.limit=0"], ["task.limit=0", "positive int"], {}),
    ("limit-zero-xsum", [*TINY, "task=bb_xsum", "task.limit=0"], ["task.limit=0", "positive int"], {}),
    ("unknown-launcher", [*TINY, "hydra/launcher=ray"], ["hydra/launcher=ray", "allowed", "basic"], {}),
    ("unknown-logger", [*TINY, "logger=tensorboard"], ["logger=tensorboard", "allowed", "wandb"], {}),
    ("dtype-unknown", [*TINY, "model.dtype=fp8"], ["dtype='fp8'", "allowed", "bf16"], {}),
    ("multirun-one-bad-job", ["-m", *TINY, "seed=0,-3"], ["seed=-3"], {}),
    # round two (issue 10): record identity, types, ranges, paths, bounded work
    ("unknown-root-key", [*TINY, "+seeds=3"], ["seeds", "no such config key", "seed"], {}),
    ("removed-key", [*TINY, "~policy.budget"], ["policy.budget", "missing"], {}),
    ("experiment-name-space", [*TINY, "experiment_name='x y'"], ["experiment_name='x y'", "allowed"], {}),
    ("experiment-name-slash", [*TINY, "experiment_name=x/y"], ["experiment_name='x/y'", "allowed"], {}),
    ("experiment-name-dotdot", [*TINY, "experiment_name=.."], ["experiment_name='..'", "allowed"], {}),
    ("runs-dir-empty", [*TINY, "runs_dir="], ["runs_dir=''", "folder"], {}),
    ("hang-xsum-no-room-for-prompt", [*TINY, "task=bb_xsum", "task.shots=0", "task.max_new_tokens=5000"],
     ["max_new_tokens=5000", "4096", "allowed: 1-2048"], {}),
    ("xsum-shots-over-pool", [*TINY, "task=bb_xsum", "task.shots=1000"],
     ["shots=1000", f"{XSUM_POOL} train", "50-150 words", f"0-{XSUM_POOL}"], {}),
    ("xsum-shots-over-usable-pool", [*TINY, "task=bb_xsum", "task.shots=50"],
     ["shots=50", f"{XSUM_POOL} train", f"0-{XSUM_POOL}"], {}),
    ("shots-bool", [*TINY, "task.shots=true"], ["task.shots=True", "an int"], {}),
    ("threads-bool", ["model=tiny-llama", "threads=true"], ["threads=True", "positive int"], {}),
    ("heavy-share-bool", [*TINY, "policy.heavy_share=true"], ["heavy_share=True", "[0, 1]"], {}),
    ("heavy-share-text", [*TINY, "policy.heavy_share=abc"], ["heavy_share='abc'", "[0, 1]"], {}),
    ("greedy-not-bool", [*TINY, "task=bb_xsum", "task.greedy=maybe"], ["task.greedy='maybe'", "true/false"], {}),
    ("temperature-text", [*TINY, "task=bb_xsum", "task.temperature=abc"], ["task.temperature='abc'", "number"], {}),
    ("add-bos-not-bool", [*TINY, "task=bb_copa", "task.add_bos_token=maybe"], ["add_bos_token='maybe'", "true/false or null"], {}),
    ("fail-fast-not-bool", [*TINY, "fail_fast=maybe"], ["fail_fast='maybe'", "true or false"], {}),
    ("budget-huge", [*TINY, "policy.budget=99999999999999999999"], ["budget=99999999999999999999", "2**40"], {}),
    ("n-windows-over-text", [*TINY, "task=austen_ppl", "task.n_windows=100000"], ["n_windows=100000", "allowed"], {}),
    ("observations-layer", [*TINY, "task=observations", "task.layer=99"], ["task.layer=99", "2 layers", "0-1"], {}),
    ("pretrained-missing", [*TINY, "model.pretrained=/nonexistent/ckpt"], ["pretrained='/nonexistent/ckpt'",
                                                                           "no such folder", "allowed"], {}),
    ("pretrained-not-checkpoint", [*TINY, "model.pretrained={tmp}/ro"], ["no config.json", "allowed"], {}),
    ("device-map-unknown", [*TINY, "model.device_map=xyz"], ["device_map='xyz'", "allowed", "auto"], {}),
    ("sweep-range-step-zero", ["-m", *TINY, "seed=range(0,1,0)"], ["range"], {}),
    ("sweep-dir-is-a-file", ["-m", *TINY, "seed=0,1", "hydra.sweep.dir={tmp}/afile"], ["hydra.sweep.dir", "afile",
                                                                                       "not a folder"], {}),
    # round three (issue 26): loads, tracebacks, silent acceptance, messages that did not name the input
    ("device-map-cpu-on-gpu-config", ["model=opt-6.7b", "model.device_map=cpu", "threads=1"],
     ["device_map='cpu'", "gpus=1", "allowed", "model.resources.gpus=0"], {}),
    ("params-zero", [*TINY, "model.params=0"], ["model.params=0", "an integer > 0", "null"], {}),
    ("params-float", [*TINY, "model.params=6.7e9"], ["model.params=6700000000.0", "an int or null"], {}),
    ("include-path-null", [*TINY, "task=bb_copa", "task.include_path=null"],
     ["task.include_path=null", "bb_copa", "built-in", "allowed: task.include_path=tasks"], {}),
    ("include-path-5000-chars", [*TINY, "task=bb_copa", "task.include_path=" + "a" * 5000],
     ["task.include_path='aaaa", "(5000 characters)", "File name too long"], {}),
    ("runs-dir-5000-chars", [*TINY, "runs_dir=" + "r" * 5000], ["runs_dir='rrrr", "(5000 characters)", "too long"],
     {}),
    ("lock-mode-bogus", TINY, ["H2O_LOCK='bogus'", "allowed: auto, flock, file"], {"H2O_LOCK": "bogus"}),
    ("lock-stale-text", TINY, ["H2O_LOCK_STALE_S='abc'", "a number > 0"], {"H2O_LOCK_STALE_S": "abc"}),
    ("budget-no-token-at-longest-context", [*TINY, "policy.budget=1e-9"],
     ["budget=1e-09", "heavy part", "x 4096 positions", "tiny-llama", "needs at least 1",
      "allowed: a ratio >= 0.000489"], {}),
    ("streaming-ratio-below-sinks", [*TINY, "policy=streaming_llm", "policy.budget=0.001"],
     ["budget=0.001", "x 4096 positions", "= 4.1 tokens", "needs at least 5", "allowed: a ratio >= 0.00122"], {}),
    ("local-ratio-no-token", [*TINY, "policy=local", "policy.budget=0.0002"],
     ["budget=0.0002", "0.819 tokens", "needs at least 1", ">= 0.000244"], {}),
    ("topk-heavy-recent-unused", [*TINY, "policy=topk", "policy.heavy=0.1", "policy.recent=0.1"],
     ["policy.heavy=0.1, policy.recent=0.1", "topk reads only the whole budget", "allowed: policy.budget=0.2"], {}),
    ("local-heavy-recent-unused", [*TINY, "policy=local", "policy.heavy=3", "policy.recent=5"],
     ["policy.heavy=3", "local reads only", "policy.budget=8"], {}),
    ("decay-unused-without-score-decay", [*TINY, "policy.decay=0.5"],
     ["policy.decay=0.5", "policy.score=decay", "score=sum"], {}),
    ("experiment-as-a-path", [*TINY, "experiment=../model/tiny-llama"],
     ["experiment=../model/tiny-llama", "not a path", "allowed", "table1"], {}),
    ("policy-as-a-path", [*TINY, "policy=../policy/h2o"], ["policy=../policy/h2o", "not a path", "streaming_llm"], {}),
    ("remove-task-group", [*TINY, "~task", "task.limit=1"], ["~task", "removes the whole task group", "bb_copa"], {}),
    ("budget-5000-digits", [*TINY, "policy.budget=" + "1" * 5000],
     ["policy.budget=11111111...", "(5000 digits)", "allowed", "2**40"], {}),
    ("unknown-flag", [*TINY, "--bogus"], ["--bogus", "unknown option", "allowed", "--multirun"], {}),
    # methods (tova, random): the whole budget, no split; random's seed
    ("tova-heavy-recent-unused", [*TINY, "policy=tova", "policy.heavy=0.1", "policy.recent=0.1"],
     ["policy.heavy=0.1", "tova reads only the whole budget", "policy.budget=0.2"], {}),
    ("tova-budget-no-token", [*TINY, "policy=tova", "policy.budget=1e-5"],
     ["budget=1e-05", "x 4096 positions", "tova needs at least 1", "allowed: a ratio >= 0.000244"], {}),
    ("tova-unknown-option", [*TINY, "policy=tova", "+policy.score=mean"],
     ["policy.score", "no such option for policy=tova", "allowed:", "heavy_share"], {}),
    # reasoning tasks (h2o.tasks.reasoning): sampling, samples per problem, generation budget, thinking switch
    ("reasoning-temperature-negative", [*TINY, "task=aime24", "task.temperature=-0.1"],
     ["task.temperature=-0.1", "allowed: a number >= 0"], {}),
    ("reasoning-top-p-zero", [*TINY, "task=aime24", "task.top_p=0"], ["task.top_p=0", "(0, 1]"], {}),
    ("reasoning-top-p-over-one", [*TINY, "task=aime24", "task.top_p=1.5"], ["task.top_p=1.5", "(0, 1]"], {}),
    ("reasoning-n-zero", [*TINY, "task=gsm8k", "task.n=0"], ["task.n=0", "an int in 1-1024"], {}),
    ("reasoning-max-gen-toks-zero", [*TINY, "task=math500", "task.max_gen_toks=0"],
     ["task.max_gen_toks=0", "an int >= 1"], {}),
    ("reasoning-max-gen-toks-over-model", [*TINY, "task=aime25", "task.max_gen_toks=5000"],
     ["task.max_gen_toks=5000", "4096 positions", "allowed: < 4096"], {}),
    ("reasoning-thinking-unknown", [*TINY, "task=aime24", "task.thinking=maybe"],
     ["task.thinking='maybe'", "true/false or null"], {}),
    ("reasoning-thinking-without-end", [*TINY, "task=aime24", "task.thinking=true"],
     ["task.thinking=true", "think_end_token"], {}),
    # the interval schedule (h2o.core.schedule): its spelling, its option, and rules without a decoding form
    ("compress-unknown", [*TINY, "+policy.compress=sometimes"], ["compress='sometimes'", "decode, prefill, interval"], {}),
    ("interval-zero", [*TINY, "+policy.compress=interval", "+policy.interval=0"], ["interval=0", "an int >= 1"], {}),
    ("interval-text", [*TINY, "+policy.compress=interval", "+policy.interval=abc"], ["interval='abc'", "an int >= 1"],
     {}),
    ("interval-missing", [*TINY, "+policy.compress=interval"], ["interval=None", "an int >= 1"], {}),
    ("interval-without-schedule", [*TINY, "+policy.interval=4"], ["interval=4", "allowed: compress=interval"], {}),
    ("interval-no-decoding-form", [*TINY, "policy=pyramidkv", "policy.compress=interval", "+policy.interval=4"],
     ["compress=interval", "pyramidkv", "allowed: prefill"], {}),
    ("r_kv-kernel-even", [*TINY, "policy=r_kv", "policy.kernel=4"], ["kernel=4", "odd int >= 1"], {}),
    ("r_kv-mix-lambda", [*TINY, "policy=r_kv", "policy.mix_lambda=1.5"], ["mix_lambda=1.5", "a number in [0, 1]"],
     {}),
    ("random-heavy-recent-unused", [*TINY, "policy=random", "policy.heavy=2", "policy.recent=2"],
     ["policy.heavy=2", "random reads only", "policy.budget=4"], {}),
    ("random-seed-negative", [*TINY, "policy=random", "policy.seed=-1"], ["seed=-1", "[0, 2**31 - 1)"], {}),
    ("random-seed-text", [*TINY, "policy=random", "policy.seed=abc"], ["seed='abc'", "an int"], {}),
    ("compress-unknown", [*TINY, "+policy.compress=later"], ["compress='later'", "allowed", "prefill"], {}),
    ("compress-prefill-on-topk", [*TINY, "policy=topk", "+policy.compress=prefill"],
     ["compress=prefill", "topk keeps the whole cache"], {}),
    # models (gemma3-270m, experiment=models): perplexity's BOS switch, the packaged model's config
    ("ppl-add-bos-not-bool", [*TINY, "task=austen_ppl", "+task.add_bos_token=maybe"],
     ["task.add_bos_token='maybe'", "true/false or null"], {}),
    ("gemma-cpu-run-of-gpu-request", ["model=gemma3-270m", "model.device_map=cpu", "model.resources.gpus=1",
                                      "threads=1"], ["device_map='cpu'", "gpus=1", "model.resources.gpus=0"], {}),
    ("gemma-params-zero", ["model=gemma3-270m", "model.params=0", "threads=1"], ["model.params=0", "an integer > 0"],
     {}),
    ("models-experiment-unknown-model", ["-m", "experiment=models", "model=gemma4"], ["model=gemma4", "allowed",
                                                                                    "gemma3-270m"], {}),
    # long-context tasks (conf/task/niah.yaml, ruler_*.yaml): grid, haystack, generation, seed
    ("niah-lengths-zero", [*TINY, *NIAH, "task.lengths=[0]"], ["task.lengths=[0]", "ints > 0"], {}),
    ("niah-lengths-text", [*TINY, *NIAH, "task.lengths=abc"], ["task.lengths='abc'", "ints > 0"], {}),
    ("niah-lengths-float", [*TINY, *NIAH, "task.lengths=[1.5]"], ["task.lengths=[1.5]", "ints > 0"], {}),
    ("niah-length-over-positions", [*TINY, *NIAH, "task.lengths=[8192]"],
     ["task.lengths=[8192]", "tiny-llama's 4096 positions", "allowed: <= 4084"], {}),
    ("niah-length-plus-generation-over-positions", [*TINY, *NIAH, "task.lengths=[4096]"],
     ["task.lengths=[4096]", "with 12 generated tokens", "allowed: <= 4084"], {}),
    ("niah-clip-none-fits", [*TINY, *NIAH, "task.lengths=[4096]", "+task.clip_to_model=true"],
     ["task.lengths=[4096]", "none fits", "allowed: <= 4084"], {}),
    ("niah-depths-over-one", [*TINY, *NIAH, "task.depths=[1.5]"], ["task.depths=[1.5]", "[0, 1]"], {}),
    ("niah-depths-empty", [*TINY, *NIAH, "task.depths=[]"], ["task.depths=[]", "[0, 1]"], {}),
    ("niah-samples-zero", [*TINY, *NIAH, "task.samples=0"], ["task.samples=0", "positive int"], {}),
    ("niah-samples-float", [*TINY, *NIAH, "task.samples=1.5"], ["task.samples=1.5", "an int"], {}),
    ("niah-text-unknown", [*TINY, *NIAH, "task.text=pg19"], ["task.text='pg19'", "allowed: austen, moby_dick"], {}),
    ("niah-text-essays", [*TINY, *NIAH, "task.text=essays"], ["task.text='essays'", "allowed: austen, moby_dick"],
     {}),
    ("niah-max-gen-toks-zero", [*TINY, *NIAH, "task.max_gen_toks=0"], ["task.max_gen_toks=0", "positive int"], {}),
    ("niah-max-gen-toks-text", [*TINY, *NIAH, "task.max_gen_toks=abc"], ["task.max_gen_toks='abc'", "an int"], {}),
    ("niah-max-gen-toks-over-positions", [*TINY, *NIAH, "task.max_gen_toks=5000"],
     ["task.max_gen_toks=5000", "4096 positions", "allowed: < 4096"], {}),
    ("niah-seed-negative", [*TINY, *NIAH, "task.seed=-1"], ["task.seed=-1", "an int >= 0"], {}),
    ("niah-shots", [*TINY, *NIAH, "task.shots=3"], ["task.shots=3", "allowed: 0"], {}),
    ("niah-batch-size-zero", [*TINY, *NIAH, "task.batch_size=0"], ["task.batch_size=0", "positive int, auto"], {}),
    ("niah-lm-eval-task-unknown", [*TINY, *NIAH, "task.lm_eval_task=nope"],
     ["task.lm_eval_task='nope'", "allowed: niah", "niah_single_2"], {}),
    ("niah-lengths-too-short", [*TINY, "task=niah", "task.lengths=[40,1024]"],
     ["task.lengths=[40, 1024]", "40 tokens are too short", "tiny-llama's tokenizer", "allowed: lengths >= 372"], {}),
    ("ruler-lengths-too-short", [*TINY, "task=ruler_niah_single_1", "task.lengths=[200]"],
     ["task.lengths=[200]", "too short for lm-eval's niah_single_1 prompt", "allowed: lengths >= 462"], {}),
    ("ruler-limit-zero", [*TINY, "task=ruler_niah_single_2", "task.limit=0"], ["task.limit=0", "positive int"], {}),
    ("ruler-text-unknown", [*TINY, "task=ruler_niah_multikey_1", "task.text=pg19"],
     ["task.text='pg19'", "allowed: austen, moby_dick, essays"], {}),
    ("ruler-lengths-zero", [*TINY, "task=ruler_niah_single_1", "task.lengths=[0]"], ["task.lengths=[0]", "ints > 0"],
     {}),
    ("ruler-max-gen-toks-fills-length", [*TINY, "task=ruler_niah_single_2", "task.max_gen_toks=1024"],
     ["task.max_gen_toks=1024", "task.lengths=[1024]", "allowed: < 1024"], {}),
    # methods (snapkv, pyramidkv): observation window, pooling kernel, pyramid ratio, prompt-only compression
    ("snapkv-window-zero", [*TINY, "policy=snapkv", "policy.window=0"], ["window=0", "int >= 1"], {}),
    ("snapkv-window-text", [*TINY, "policy=snapkv", "policy.window=abc"], ["window='abc'", "int >= 1"], {}),
    ("snapkv-kernel-even", [*TINY, "policy=snapkv", "policy.kernel=4"], ["kernel=4", "odd int >= 1"], {}),
    ("snapkv-kernel-zero", [*TINY, "policy=snapkv", "policy.kernel=0"], ["kernel=0", "odd int >= 1"], {}),
    ("pyramidkv-compress-decode", [*TINY, "policy=pyramidkv", "policy.compress=decode"],
     ["compress=decode", "end of a prompt", "allowed: prefill"], {}),
    ("pyramidkv-beta-below-one", [*TINY, "policy=pyramidkv", "policy.beta=0.5"], ["beta=0.5", "number >= 1"], {}),
    ("pyramidkv-beta-text", [*TINY, "policy=pyramidkv", "policy.beta=abc"], ["beta='abc'", "number >= 1"], {}),
    ("pyramidkv-kernel-even", [*TINY, "policy=pyramidkv", "policy.kernel=4"], ["kernel=4", "odd int >= 1"], {}),
    ("tova-heavy-alone", [*TINY, "policy=tova", "policy.heavy=0.1"], ["heavy=0.1", "give both or neither"], {}),
    # the paper code's rule: one-pass scoring only
    ("h2o-reference-generation", [*TINY, "policy=h2o_reference", "task=bb_xsum"],
     ["policy=h2o_reference", "one-pass scoring", "bb_xsum"], {}),
    ("h2o-reference-niah", [*TINY, "policy=h2o_reference", *NIAH], ["policy=h2o_reference", "niah (retrieval)"], {}),
    ("h2o-reference-semantics-real", [*TINY, "policy=h2o_reference", "semantics=real"],
     ["semantics=real", "allowed: semantics=auto"], {}),
    # round four (issue 38): token counts past the model, data not prefetched, non-finite floats, the model's config
    ("scissorhands-history-over-positions", [*TINY, "policy=scissorhands", "policy.history=1000000000000"],
     ["history=1000000000000", "longer than any sequence", "4096 positions", "allowed: history in 1-4096"], {}),
    ("snapkv-window-over-positions", [*TINY, "policy=snapkv", "policy.window=5000"],
     ["window=5000", "4096 positions", "allowed: window in 1-4096"], {}),
    ("ruler-qa-hotpot-not-fetched", [*TINY, "task=ruler_qa_hotpot", "task.lengths=[1024]"],
     ["task=ruler_qa_hotpot", "not on this machine", "hotpot_dev_distractor_v1.json", "make prefetch"],
     {"H2O_CACHE": "{tmp}/cache"}),
    ("ruler-qa-squad-not-fetched", [*TINY, "task=ruler_qa_squad", "task.lengths=[1024]"],
     ["task=ruler_qa_squad", "dev-v2.0.json", "make prefetch"], {"H2O_CACHE": "{tmp}/cache"}),
    ("ruler-essays-not-fetched", [*TINY, "task=ruler_niah_single_2", "task.text=essays"],
     ["task=ruler_niah_single_2", "baber/paul_graham_essays", "make prefetch"], {"HF_HOME": "{tmp}/hf"}),
    ("longbench-not-fetched", [*TINY, "task=longbench", "task.lengths=[2048]"],
     ["task=longbench", "Xnhyacinth/LongBench", "make prefetch"], {"HF_HOME": "{tmp}/hf"}),
    ("pyramidkv-beta-inf", [*TINY, "policy=pyramidkv", "policy.beta=inf"],
     ["policy.beta=inf", "not a finite number", "allowed"], {}),
    ("heavy-share-nan", [*TINY, "policy.heavy_share=nan"], ["policy.heavy_share=nan", "not a finite number"], {}),
    ("budget-nan", [*TINY, "policy.budget=nan"], ["policy.budget=nan", "not a finite number"], {}),
    ("decay-inf", [*TINY, "policy.score=decay", "policy.decay=inf"], ["policy.decay=inf", "not a finite number"], {}),
    ("expected-attention-epsilon-inf", [*TINY, "policy=expected_attention", "policy.epsilon=inf"],
     ["policy.epsilon=inf", "not a finite number"], {}),
    ("niah-depths-nan", [*TINY, *NIAH, "task.depths=[nan]"], ["task.depths[0]=nan", "not a finite number"], {}),
    ("expected-attention-no-rotary", ["model=tiny-opt", "threads=1", "policy=expected_attention"],
     ["policy=expected_attention", "model tiny-opt has no rotary embedding in its config",
      "allowed: a model with rotary embeddings"], {}),
    ("niah-lengths-int", [*TINY, "task=niah", "task.lengths=512"],
     ["task.lengths=512", "expected a list", "task.lengths=[512]", "allowed: a list of token counts (ints > 0)"], {}),
    ("niah-depths-number", [*TINY, *NIAH, "task.depths=0.5"],
     ["task.depths=0.5", "expected a list", "allowed: a list of fractions in [0, 1]"], {}),
    # the new options: schedules, generation budgets, reasoning, questions per context, kvzip, r_kv, attention
    ("interval-over-positions", [*TINY, "+policy.compress=interval", "+policy.interval=4097"],
     ["interval=4097", "4096 positions", "allowed: interval in 1-4096"], {}),
    ("interval-bool", [*TINY, "+policy.compress=interval", "+policy.interval=true"], ["interval=True", "an int >= 1"],
     {}),
    ("long-generation-over-positions", [*TINY, "task=long_generation", "task.max_new_tokens=5000"],
     ["task.max_new_tokens=5000", "4096 positions", "allowed: max_new_tokens + passage_tokens <= 4045"], {}),
    ("long-generation-trace-zero", [*TINY, "task=long_generation", "task.trace_every=0"],
     ["task.trace_every=0", "allowed: an int >= 1"], {}),
    ("r_kv-budget-ratio-over-one", [*TINY, "policy=r_kv", "policy.budget=128.5"], ["budget=128.5", "(0, 1]", "an int"],
     {}),
    ("r_kv-window-zero", [*TINY, "policy=r_kv", "policy.window=0"], ["window=0", "allowed: an int >= 1"], {}),
    ("r_kv-window-over-positions", [*TINY, "policy=r_kv", "policy.window=5000"], ["window=5000", "allowed: window in "
                                                                                  "1-4096"], {}),
    ("r_kv-threshold", [*TINY, "policy=r_kv", "policy.threshold=2"], ["threshold=2", "a number in [-1, 1]"], {}),
    ("r_kv-threshold-nan", [*TINY, "policy=r_kv", "policy.threshold=nan"], ["threshold=nan", "not a finite number"],
     {}),
    ("reasoning-temperature-inf", [*TINY, "task=aime24", "task.temperature=inf"],
     ["task.temperature=inf", "not a finite number"], {}),
    ("reasoning-top-p-nan", [*TINY, "task=aime24", "task.top_p=nan"], ["task.top_p=nan", "not a finite number"], {}),
    ("reasoning-n-float", [*TINY, "task=aime24", "task.n=1.5"], ["task.n=1.5", "an int"], {}),
    ("reasoning-chat-template-not-bool", [*TINY, "task=aime24", "task.chat_template=maybe"],
     ["task.chat_template='maybe'", "true/false"], {}),
    ("reasoning-think-end-empty", [*TINY, "task=aime24", "task.thinking=true", "task.think_end_token=''"],
     ["task.think_end_token=''", "allowed: null or a text"], {}),
    ("reasoning-lm-eval-task-unknown", [*TINY, "task=gsm8k", "task.lm_eval_task=nope"],
     ["task.lm_eval_task='nope'", "allowed: aime24", "gsm8k_cot_zeroshot"], {}),
    ("reasoning-data-files-missing", [*TINY, "task=math500", "task.data_files={tmp}/nope.jsonl"],
     ["task.data_files=", "nope.jsonl", "no such file", "allowed: null or a JSON file"], {}),
    ("reasoning-hub-data-not-fetched", [*TINY, "task=gsm8k", "task.chat_template=false"],
     ["task=gsm8k", "not on this machine", "openai/gsm8k", "make prefetch", "task.data_files"], {"HF_HOME": "{tmp}/hf"}),
    ("reasoning-no-chat-template", [*TINY, "task=aime24", f"task.data_files={REASONING_DATA}/aime24.jsonl"],
     ["task.chat_template=true", "tiny-llama's tokenizer has no chat template", "allowed: task.chat_template=false"],
     {}),
    ("questions-over-keys", [*TINY, *NIAH, "task.questions=1000"],
     ["task.questions=1000", "728 distinct keys", "allowed: task.questions in 1-728"], {}),
    ("questions-zero", [*TINY, *NIAH, "task.questions=0"], ["task.questions=0", "an int >= 1"], {}),
    ("turns-bool", [*TINY, *NIAH, "task.turns=true"], ["task.turns=True", "an int"], {}),
    ("questions-float-one", [*TINY, *NIAH, "task.questions=1.0"], ["task.questions=1.0", "an int"], {}),
    ("questions-and-turns", [*TINY, *NIAH, "task.questions=3", "task.turns=2"],
     ["task.questions=3, task.turns=2", "allowed: one of them above 1"], {}),
    ("questions-on-ruler", [*TINY, "task=ruler_niah_single_1", "+task.questions=3"],
     ["task.questions=3", "niah and RULER's split tasks", "allowed: task.questions=1"], {}),
    ("kvzip-n-sink-negative", [*TINY, "policy=kvzip", "policy.n_sink=-1"], ["n_sink=-1", "an int >= 0"], {}),
    ("kvzip-chunk-size-zero", [*TINY, "policy=kvzip", "policy.chunk_size=0"], ["chunk_size=0", "an int >= 1"], {}),
    ("kvzip-layerwise-not-bool", [*TINY, "policy=kvzip", "policy.layerwise=maybe"], ["layerwise='maybe'", "true"], {}),
    ("kvzip-n-sink-over-positions", [*TINY, "policy=kvzip", "policy.n_sink=100000", "task=bb_xsum"],
     ["n_sink=100000", "4096 positions", "allowed: n_sink in 0-4096"], {}),
    ("kvzip-chunk-size-over-positions", [*TINY, "policy=kvzip", "policy.chunk_size=1000000000000", "task=bb_xsum"],
     ["chunk_size=1000000000000", "allowed: chunk_size in 1-4096"], {}),
    ("kvzip-compress-decode", [*TINY, "policy=kvzip", "policy.compress=decode", "task=bb_xsum"],
     ["compress=decode", "kvzip", "allowed: prefill"], {}),
    ("kvzip-simulated", [*TINY, "policy=kvzip"], ["policy=kvzip", "semantics=simulated", "allowed: a task that runs "
                                                                                         "the real path"], {}),
    ("attn-implementation-unknown", [*TINY, "model.attn_implementation=foo"],
     ["model.attn_implementation='foo'", "allowed: auto, sdpa, eager"], {}),
    ("attn-implementation-null", [*TINY, "model.attn_implementation=null"],
     ["model.attn_implementation=None", "expected a string"], {}),
    ("attn-implementation-flash-fp32", [*TINY, "model.attn_implementation=flash_attention_2"],
     ["model.attn_implementation=flash_attention_2", "dtype fp16 or bf16", "dtype=fp32", "allowed: auto"], {}),
]


@pytest.fixture(scope="module", autouse=True)
def offline_data():
    """The converted bb_copa split (a line count of its train file is what the shots check reads); at the end,
    drop the model the real runs left cached."""
    from h2o.assets import model_spec as models_spec
    from h2o.assets.data import write_task

    write_task("bb_copa")
    yield
    models_spec.release()  # the real runs below keep the tiny model cached; later tests expect none loaded


@pytest.mark.parametrize("case, args, words, env", [c if hasattr(c, "marks") else pytest.param(*c, id=c[0])
                                                     for c in BAD])
def test_bad_input_one_line_exit_2_nothing_loaded(case, args, words, env, capsys, tmp_path, monkeypatch):
    from h2o.assets import model_spec as models_spec
    from h2o.pipeline.run import main

    (tmp_path / "badtasks").mkdir()
    (tmp_path / "badtasks" / "bb_copa.yaml").write_text("task: bb_copa\n  dataset_path: [unclosed\n")
    (tmp_path / "afile").write_text("not a folder\n")
    (tmp_path / "ro").mkdir(mode=0o555)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("H2O_RUNS", raising=False)
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v.replace("{tmp}", str(tmp_path)))
    models_spec._LOADED.clear()
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    assert main(args) == 2
    err = refusal(capsys)
    assert err.startswith("error:") and len(err.splitlines()) == 1 and len(err) < 1000, err
    assert all(w in err for w in words), (words, err)
    assert not models_spec._LOADED
    assert not (tmp_path / "runs").exists() and not (tmp_path / "ro" / "runs").exists()
    assert not (tmp_path / "multirun").exists() and not (tmp_path / "outputs").exists()


# ------------------------------------------------------------------------------------ real runs
XSUM = ["task=bb_xsum", "task.limit=2", "task.shots=1", "task.max_new_tokens=6", "task.doc_max_words=60",
        "task.batch_size=2", "policy.budget=0.5"]
COPA = ["task=bb_copa", "task.limit=3", "task.shots=1", "policy.budget=0.5"]
PPL = ["task=austen_ppl", "task.n_windows=1", "task.window=48", "policy=streaming_llm", "policy.budget=0.5"]


def run_ok(args: list[str], runs: Path) -> Path:
    from h2o.pipeline.run import main

    assert main([*TINY, "seed=7", f"runs_dir={runs}", *args]) == 0
    found = sorted(runs.rglob("metrics.json"))
    return found


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    """The same two configs (generation through the real cache; multiple choice) run into two runs_dirs."""
    base = tmp_path_factory.mktemp("determinism")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(base)
        for name in ("a", "b"):
            for args in (XSUM, COPA):
                run_ok(args, base / name)
    return base / "a", base / "b"


def test_same_config_and_seed_give_identical_records(two_runs):
    a, b = two_runs
    runs_a = {p.parent.relative_to(a): p.parent for p in a.rglob("metrics.json")}
    runs_b = {p.parent.relative_to(b): p.parent for p in b.rglob("metrics.json")}
    assert set(runs_a) == set(runs_b) and len(runs_a) == 2
    kinds = set()
    for rel in runs_a:
        ma, mb = (json.loads((r[rel] / "metrics.json").read_text()) for r in (runs_a, runs_b))
        assert ma["metrics"] == mb["metrics"] and ma["n_samples"] == mb["n_samples"] > 0
        sa, sb = (read_jsonl(r[rel] / "samples.jsonl") for r in (runs_a, runs_b))
        assert sa == sb, rel
        kinds.add(ma["task_kind"])
        if ma["task_kind"] == "summarization":
            gens = [s.get("generation", s.get("output")) for s in sa]
            assert len(gens) == 2 and all(isinstance(g, str) for g in gens), sa[0].keys()
    assert kinds == {"summarization", "multiple_choice"}


def test_record_names_its_provenance(two_runs):
    a, _ = two_runs
    for metrics_file in a.rglob("metrics.json"):
        env = json.loads((metrics_file.parent / "env.json").read_text())
        assert len(env["git_commit"]) == 40 and isinstance(env["git_dirty"], bool)
        for pkg in ("torch", "transformers", "lm_eval"):
            assert env["packages"][pkg], pkg
        assert env["packages"]["torch"] == torch.__version__.split("+")[0] or env["packages"]["torch"] in torch.__version__
        assert env["device"] in ("cpu", "cuda") and env["device_name"] is not None
        rec = json.loads(metrics_file.read_text())
        assert rec["semantics"] in ("simulated", "real") and rec["seed"] == 7
        assert rec["semantics"] == ("real" if rec["task_kind"] == "summarization" else "simulated")
        assert rec["policy"] == "h2o" and rec["budget"] == 0.5 and {"heavy", "recent"} <= rec.keys()
        assert rec["policy_options"] == {"budget": 0.5, "heavy": None, "recent": None, "heavy_share": 0.5,
                                         "score": "sum", "decay": 0.99}


def test_misconfigured_wandb_never_fails_the_run(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("WANDB_INIT_TIMEOUT", "10")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb_config"))
    monkeypatch.setenv("NETRC", str(tmp_path / "no.netrc"))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    runs = tmp_path / "runs"
    found = run_ok([*PPL, "logger=wandb"], runs)
    assert len(found) == 1
    folder = found[0].parent
    assert {p.name for p in folder.iterdir()} >= {"config.yaml", "samples.jsonl", "env.json", "metrics.json"}
    rec = json.loads(found[0].read_text())
    assert rec["n_samples"] == len(read_jsonl(folder / "samples.jsonl")) == 1 and rec["metrics"]["ppl"] > 0
    assert "wandb mirror failed" in capsys.readouterr().err


# ------------------------------------------------------------------- every other entry point (one table each)
def no_load(monkeypatch):
    """Loading a model is an error in these tests: bad input must fail first."""
    import h2o.assets.model_spec as model_spec
    import h2o.assets.models as models

    def refuse(*a, **k):
        raise AssertionError("a model was loaded before the bad input was reported")

    monkeypatch.setattr(models, "load_model", refuse)
    monkeypatch.setattr(model_spec, "load_model", refuse)  # the name ModelSpec.load calls
    monkeypatch.setattr(model_spec, "_LOADED", {})  # nor one kept from an earlier test


def one_line_exit_2(code, capsys, words):
    err = refusal(capsys)
    assert code == 2, err
    assert err.startswith("error:") and len(err.splitlines()) == 1, err
    assert all(w in err for w in words), (words, err)


SWEEP_BAD = [
    (["model=tiny-llama", "policy.budget=0.2,1.5"], ["budget=1.5", "(0, 1]"]),
    (["model=tiny-llama", "policy=local,topk", "policy.heavy=0.1", "policy.recent=0.1"], ["local reads only"]),
    (["model=tiny-llama", "experiment=../model/tiny-llama"], ["not a path", "allowed"]),
    (["model=tiny-llama", "+foo=1"], ["foo", "no such config key"]),
    (["model=tiny-llama", "experiment_name=x:y"], ["experiment_name='x:y'", "allowed"]),
    (["model=tiny-llama", "--bogus"], ["--bogus", "unknown option"]),
]


@pytest.mark.parametrize("args, words", SWEEP_BAD, ids=["budget", "unused-split", "experiment-path", "unknown-key",
                                                        "experiment-name", "unknown-flag"])
def test_sweep_dry_run_bad_input(args, words, capsys, tmp_path, monkeypatch):
    from h2o.pipeline.sweep import main

    monkeypatch.chdir(tmp_path)
    no_load(monkeypatch)
    one_line_exit_2(main(args), capsys, words)


BENCH_BAD = [
    (["--budget", "abc"], ["--budget='abc'", "'abc' is not"]),
    (["--repeats", "0"], ["--repeats=0", ">= 1"]),
    (["--prompt", "0"], ["--prompt='0'", "an int >= 1"]),
    (["--prompt", "64", "--budget", "0.01"], ["budget=0.01", "x 64 positions (--prompt 64", "allowed: a ratio >="]),
    (["--baselines", "foo"], ["--baselines", "'foo'", "sdpa"]),
    (["--policies", "lru"], ["--policies", "'lru'", "h2o"]),
    (["--repeats", "abc"], ["--repeats", "invalid int"]),
    (["--model", "/nonexistent"], ["--model='/nonexistent'", "no such folder"]),
    (["--json", "{tmp}/afile/out.jsonl"], ["--json", "afile", "not a folder"]),
]


@pytest.mark.parametrize("args, words", BENCH_BAD, ids=[" ".join(a[:1] + a[1:2]) for a, _ in BENCH_BAD])
def test_bench_cli_bad_input(args, words, capsys, tmp_path, monkeypatch):
    from h2o.bench.__main__ import main

    cli_bad_input(main, args, words, capsys, tmp_path, monkeypatch)


def cli_bad_input(main, args, words, capsys, tmp_path, monkeypatch):
    """``main(--model tiny:llama *args)`` ({tmp}: tmp_path, which holds a file ``afile``) exits 2 in one line."""
    (tmp_path / "afile").write_text("x")
    no_load(monkeypatch)
    code = main([a.replace("{tmp}", str(tmp_path)) for a in ["--model", "tiny:llama", *args]])
    one_line_exit_2(code, capsys, words)


STREAM_BAD = [
    (["--budgets", "abc"], ["--budgets='abc'", "cache size in tokens"]),
    (["--budgets", "0.2"], ["--budgets='0.2'", "cache size in tokens"]),
    (["--policies", "lru"], ["--policies", "'lru'", "streaming_llm"]),
    (["--chunk", "0"], ["--chunk=0", ">= 1"]),
    (["--tokens", "-5"], ["--tokens=-5", ">= 1"]),
    (["--text", "/nonexistent.txt"], ["--text='/nonexistent.txt'", "austen"]),
    (["--policies", "streaming_llm", "--budgets", "3"], ["budget=3", "sinks"]),
    (["--json", "{tmp}/afile/out.jsonl"], ["--json", "afile", "not a folder"]),
    (["--runs", "{tmp}/runs"], ["--runs=", "writes no run record", "experiment=streaming"]),
]


@pytest.mark.parametrize("args, words", STREAM_BAD, ids=[" ".join(a) for a, _ in STREAM_BAD])
def test_streaming_cli_bad_input(args, words, capsys, tmp_path, monkeypatch):
    from h2o.tasks.streaming_cli import main

    cli_bad_input(main, args, words, capsys, tmp_path, monkeypatch)


LM_EVAL_BAD = [
    ("pretrained=tiny:llama,policy=nope", ["policy='nope'", "allowed", "h2o"]),
    ("pretrained=tiny:llama,policy=h2o,budget=abc", ["budget='abc'", "ratio"]),
    ("pretrained=tiny:llama,policy=h2o,semantics=exact", ["semantics='exact'", "simulated"]),
    ("pretrained=tiny:llama,policy=h2o,scoring=avg", ["scoring='avg'", "sum"]),
    ("pretrained=/nonexistent,policy=h2o", ["pretrained='/nonexistent'", "no such folder"]),
    ("pretrained=tiny:llama,quant=int4", ["quant='int4'", "allowed: none, uniform, kvquant"]),
    ("pretrained=tiny:llama,quant=uniform,quant_bits=5", ["quant.bits=5", "2, 3, 4, 8"]),
    ("pretrained=tiny:llama,quant=uniform,quant_group_size=12", ["group_size=12", "head size 16"]),
    ("pretrained=tiny:llama,quant=uniform,quant_foo=1", ["quant_foo", "allowed: quant_bits, quant_group_size"]),
    ("pretrained=tiny:llama,quant_bits=4", ["quant_bits", "quant=none takes no options"]),
    ("pretrained=tiny:opt,quant=kvquant,quant_per_channel_keys=false,quant_nonuniform=false",
     ["quant.pre_rope=true", "no rotary"]),
    ("pretrained=tiny:llama,quant=kvquant,quant_calibration=/nowhere.pt", ["'/nowhere.pt': no such file"]),
    ("pretrained=tiny:llama,policy=topk,heavy=0.1,recent=0.1", ["--model_args heavy=0.1", "topk reads only"]),
    ("pretrained=tiny:llama,policy=h2o,budget=1e-9", ["budget=1e-09", "x 4096 positions", "allowed: a ratio >="]),
    # round four (issue 38): every key checked up front, with the allowed list
    ("pretrained=tiny:llama,question=sideways", ["--model_args question='sideways'", "allowed: prompt, after"]),
    ("pretrained=tiny:llama,policy=tova,windw=8",
     ["--model_args windw=8", "no such option of --model h2o (policy=tova)", "allowed: pretrained, policy",
      "quant_<option>", "policy=tova's options (budget, heavy, recent, heavy_share, compress, interval)", "HFLM arguments",
      "max_length"]),
    ("pretrained=tiny:opt,policy=expected_attention", ["policy=expected_attention", "tiny:opt has no rotary"]),
    ("pretrained=tiny:llama,policy=scissorhands,history=1000000000000",
     ["history=1000000000000", "allowed: history in 1-4096"]),
    ("pretrained=tiny:llama,policy=pyramidkv,beta=inf", ["beta=inf", "not a finite number"]),
    ("pretrained=tiny:llama,policy=h2o,compress=interval,interval=5000", ["interval=5000", "allowed: interval in 1-4096"]),
]


@pytest.mark.parametrize("model_args, words", LM_EVAL_BAD, ids=[a.split(",")[-1] for a, _ in LM_EVAL_BAD])
def test_lm_eval_cli_bad_input(model_args, words, capsys, tmp_path, monkeypatch):
    from lm_eval.models.huggingface import HFLM

    from h2o.tasks import lm_eval_cli

    def refuse(*a, **k):
        raise AssertionError("model loaded")

    refuse.__signature__ = inspect.signature(HFLM.__init__)  # the wrapper lists HFLM's arguments as allowed keys
    monkeypatch.setattr(HFLM, "__init__", refuse)
    monkeypatch.setattr("sys.argv", ["lm_eval_cli", "--model", "h2o", "--model_args", model_args, "--tasks",
                                     "bb_copa", "--include_path", "tasks", "--output_path", str(tmp_path / "out")])
    one_line_exit_2(lm_eval_cli.main(), capsys, words)


def test_lm_eval_cli_refuses_ruler_qa_without_its_data(capsys, tmp_path, monkeypatch):
    """``--tasks ruler_qa_hotpot`` with its JSON not fetched: one line naming make prefetch, before any load."""
    from lm_eval.models.huggingface import HFLM

    from h2o.tasks import lm_eval_cli

    monkeypatch.setenv("H2O_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(HFLM, "__init__", lambda *a, **k: (_ for _ in ()).throw(AssertionError("model loaded")))
    monkeypatch.setattr("sys.argv", ["lm_eval_cli", "--model", "hf", "--model_args", "pretrained=x", "--tasks",
                                     "ruler_qa_hotpot", "--output_path", str(tmp_path / "out")])
    one_line_exit_2(lm_eval_cli.main(), capsys, ["--tasks ruler_qa_hotpot", "not on this machine",
                                                 "hotpot_dev_distractor_v1.json", "make prefetch"])


def test_analysis_cli_bad_paths(capsys, tmp_path):
    from analysis.__main__ import main

    (tmp_path / "afile").write_text("x")
    for what in ("report", "models"):
        one_line_exit_2(main([what, "--runs", str(tmp_path / "nonexistent"), "--out", str(tmp_path / "o")]), capsys,
                        ["--runs=", "nonexistent", "no such folder"])
    one_line_exit_2(main(["tables", "--runs", str(tmp_path), "--out", str(tmp_path / "afile")]), capsys,
                    ["--out=", "afile", "not a folder"])
    one_line_exit_2(main(["tables", "--runs", str(tmp_path / "afile")]), capsys, ["--runs=", "not a folder"])
    for argv, words in ((["tables", "--bogus"], ["python -m analysis", "--bogus"]),
                        (["tabels"], ["python -m analysis", "'tabels'", "tables"])):
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        one_line_exit_2(exit_.value.code, capsys, words)


PARITY_BAD = [
    (["--out", "{tmp}/afile/parity"], ["--out=", "afile", "not a folder"]),
    (["--table", "{tmp}"], ["--table=", "expected a file path, not a folder"]),
    (["--sides", "torch"], ["--sides", "'torch' unknown", "kvpress, h2o"]),
    (["--sides", "kvpress", "--venv", "{tmp}/novenv"], ["--venv=", "novenv", "tools/parity/setup_venv.sh"]),
    (["--threads", "0"], ["--threads='0'", "an int >= 1"]),
    (["--ratios", "abc"], ["--ratios='abc'", "a number in (0, 1)"]),
    (["--bogus"], ["python -m h2o.parity", "unrecognized arguments: --bogus"]),
]


@pytest.mark.parametrize("args, words", PARITY_BAD, ids=[" ".join(a[:1]) + ("-" + a[1] if len(a) > 1 else "")
                                                         for a, _ in PARITY_BAD])
def test_parity_cli_bad_input(args, words, capsys, tmp_path, monkeypatch):
    """``python -m h2o.parity`` (make parity): bad values stop before the model loads or anything is written."""
    from h2o.parity import driver as parity

    (tmp_path / "afile").write_text("x")
    no_load(monkeypatch)
    one_line_exit_2(parity.main([a.replace("{tmp}", str(tmp_path)) for a in args]), capsys, words)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]


RESULTS_BAD = [
    (["--studies", "{tmp}/nonexistent"], ["--studies=", "nonexistent", "no such folder"]),
    (["--studies", "{tmp}", "--out", "{tmp}/afile/pages"], ["--out=", "afile", "not a folder"]),
    (["--studies", "s" * 5000], ["--studies='ssss", "(5000 characters)", "File name too long"]),
    (["--collect", "{tmp}/nope", "{tmp}/dest"], ["--collect RUNS=", "nope", "no such folder"]),
    (["--collect", "{tmp}", "{tmp}/afile/dest"], ["--collect DEST=", "afile", "not a folder"]),
    (["--collect", "{tmp}", "{tmp}/dest", "--studies", "{tmp}/nonexistent"], ["--studies=", "no such folder"]),
]


@pytest.mark.parametrize("args, words", RESULTS_BAD, ids=["studies-missing", "out-under-a-file", "studies-5000",
                                                          "collect-runs-missing", "collect-dest-under-a-file",
                                                          "collect-then-bad-studies"])
def test_results_pages_cli_bad_input(args, words, capsys, tmp_path):
    """``python -m analysis.results_pages`` (make docs-results): every path checked before anything is written."""
    from analysis import results_pages

    (tmp_path / "afile").write_text("x")
    (tmp_path / "runs" / "r").mkdir(parents=True)
    (tmp_path / "runs" / "r" / "metrics.json").write_text(json.dumps({"model": "m", "metrics": {}}))
    one_line_exit_2(results_pages.main([a.replace("{tmp}", str(tmp_path)) for a in args]), capsys, words)
    assert not (tmp_path / "dest").exists() and not (tmp_path / "pages").exists()


STUDY = "title: t\nkind: records\nrecords: records\n"
STUDY_BAD = [  # (id, study.yaml, words): a study's home (studies/<study>/study.yaml) that does not describe it
    ("kind-unknown", "title: t\nkind: tables\n", ["kind='tables'", "allowed: records, streaming, methods"]),
    ("title-missing", "kind: records\n", ["'title' missing", "allowed: a mapping with title, kind"]),
    ("not-yaml", "title: [unclosed\n", ["study.yaml: not YAML", "allowed: a mapping with title"]),
    ("unknown-key", STUDY + "colour: red\n", ["colour='red'", "no such key", "allowed: title, about"]),
    ("records-a-file", "title: t\nkind: records\nrecords: afile\n",
     ["records='afile'", "not a folder in the study's home", "allowed: a folder name relative to it"]),
    ("records-outside-home", "title: t\nkind: records\nrecords: ../../runs\n", ["records='../../runs'",
                                                                               "not a folder in the study's home"]),
    ("sections-samples-outside", "title: t\nkind: streaming\nsections: [{title: x, samples: /tmp}]\n",
     ["sections[0].samples='/tmp'", "not a folder in the study's home"]),
    ("commands-not-a-list", STUDY + "commands: 3\n", ["commands=3", "allowed: a list of command lines"]),
    ("runs-text", STUDY + "runs: abc\n", ["runs='abc'", "allowed: the grid's run count (an int >= 1)"]),
]


@pytest.mark.parametrize("case, text, words", STUDY_BAD, ids=[c[0] for c in STUDY_BAD])
def test_results_pages_bad_study_home(case, text, words, capsys, tmp_path):
    """A bad ``study.yaml`` beside a good study: one line naming the file, the key and what is allowed, before any
    page is written (the good study's included)."""
    from analysis import results_pages

    for name, yaml_text in (("a_good", STUDY), ("b_bad", text)):
        (tmp_path / "studies" / name / "records").mkdir(parents=True)
        (tmp_path / "studies" / name / "study.yaml").write_text(yaml_text)
    (tmp_path / "studies" / "b_bad" / "afile").write_text("x")
    code = results_pages.main(["--studies", str(tmp_path / "studies"), "--out", str(tmp_path / "pages")])
    one_line_exit_2(code, capsys, ["b_bad/study.yaml", *words])
    assert not (tmp_path / "pages").exists()


# --------------------------------------------------------------------------------------- record identity
def plan_for(args: list[str], runs: Path):
    from hydra import compose, initialize_config_dir

    from h2o.pipeline.spec import prepare
    from h2o.assets.paths import CONF

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return prepare(compose(config_name="config", overrides=[*TINY, f"runs_dir={runs}", *args]))


def test_record_identity_is_exact_and_a_differing_record_is_never_reused(tmp_path):
    from omegaconf import OmegaConf

    from h2o.assets.model_spec import ConfigError
    from h2o.store.files import write_json
    from h2o.store.folders import fmt

    assert fmt(0.2000001) != fmt(0.2) and fmt(0.19999999) != fmt(0.2) and fmt(0.2) == "0.2"
    assert len({fmt("x_y"), fmt("x y"), fmt("x/y"), fmt("x:y")}) == 4 and "/" not in fmt("x/y")
    assert fmt("..") not in ("..", ".") and not fmt("../x").startswith(".")
    spec = plan_for(["policy.budget=0.2"], tmp_path)
    assert spec.path != plan_for(["policy.budget=0.2000001"], tmp_path).path
    assert plan_for(["model.name='x y'"], tmp_path).path != plan_for(["model.name=x_y"], tmp_path).path
    spec.path.mkdir(parents=True)
    (spec.path / "config.yaml").write_text(OmegaConf.to_yaml(spec.cfg, resolve=True))
    write_json(spec.path / "metrics.json", {**spec.head(), "metrics": {}, "n_samples": 0, "wall_s": 0.0})  # complete
    assert plan_for(["policy.budget=0.2"], tmp_path).path == spec.path  # its own config: reused (skipped)
    stored = OmegaConf.load(spec.path / "config.yaml")
    stored.policy.heavy_share = 0.25  # as if an older run with another split had left its record here
    (spec.path / "config.yaml").write_text(OmegaConf.to_yaml(stored))
    with pytest.raises(ConfigError, match="different config .*policy.heavy.*not reused"):
        plan_for(["policy.budget=0.2"], tmp_path)


# ------------------------------------------------------------------------------------------- bounded work
def test_prompt_builder_always_terminates():
    from h2o.assets.model_spec import ConfigError
    from h2o.assets.tiny import byte_tokenizer
    from h2o.tasks.summarization import SummarizationTask

    task = SummarizationTask("bb_xsum", dataset="bb_xsum", shots=0, max_new_tokens=5000)
    row = {"article": "word " * 300, "summary": "s"}
    with pytest.raises(ConfigError, match="max_new_tokens=5000: even an empty article"):
        task.prompt([], row, byte_tokenizer(), 4096 - 5000)
    assert len(task.prompt([], row, byte_tokenizer(), 200)) <= 200  # cut from the left until it fits


# ------------------------------------------------------------------------------------------- analysis
def test_analysis_skips_malformed_records_and_flags_nan(tmp_path, capsys):
    from analysis.__main__ import main
    from analysis.records import load_runs

    good = {"experiment": "x", "model": "m", "task": "copa", "task_kind": "multiple_choice", "policy": "h2o",
            "budget": 0.2, "shots": 0, "semantics": "simulated", "seed": 0, "n_samples": 3, "metrics": {"acc": 0.5}}
    for name, content in {"good": good, "list": [1, 2, 3], "int-metrics": {**good, "metrics": 5},
                          "nan": {**good, "seed": 1, "metrics": {"acc": float("nan"), "acc_norm": 0.25}},
                          "torn": None}.items():
        (tmp_path / name).mkdir()
        text = json.dumps(content) if content is not None else '{"experiment": "x", "metr'
        (tmp_path / name / "metrics.json").write_text(text)
    df = load_runs(tmp_path)
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert sorted(Path(p).name for p in df.path) == ["good", "nan"]
    assert len([w for w in warnings if w.startswith("warning: skipping malformed")]) == 3
    assert any("list" in w for w in warnings) and any("int-metrics" in w and "metrics" in w for w in warnings)
    nan = df[df.path.str.endswith("nan")].iloc[0]
    assert nan.nonfinite_metrics == "acc" and np.isnan(nan.acc) and nan.acc_norm == 0.25
    assert df.acc.mean() == 0.5  # the NaN run is not averaged in
    assert main(["tables", "--runs", str(tmp_path), "--out", str(tmp_path / "out")]) == 0
    assert list((tmp_path / "out" / "tables").glob("*.md"))


# ------------------------------------------------------------------------------------------- API guards
@pytest.fixture(scope="module")
def tiny():
    from h2o.assets.models import tiny_model
    from h2o.assets.tiny import byte_tokenizer

    return tiny_model("llama"), byte_tokenizer()


def test_api_guards(tiny):
    from h2o import PolicyError, attach, make_policy

    model, _ = tiny
    ids = torch.randint(3, 200, (1, 12), generator=torch.Generator().manual_seed(0))
    ref = model(ids).logits
    policy = make_policy("h2o", budget=0.5)
    with attach(model, policy):
        with pytest.raises(PolicyError, match="attached already"):
            with attach(model, policy):
                pass
    assert model.config._attn_implementation == "eager" and torch.equal(model(ids).logits, ref)  # restored
    with pytest.raises(PolicyError, match="expected a Policy"):
        with attach(model, "h2o"):
            pass
    with pytest.raises(PolicyError, match="prompt_len=-5"):
        with attach(model, policy, prompt_len=-5):
            pass
    with pytest.raises(PolicyError, match="2\\*\\*40"):
        make_policy("h2o", budget=10**30)
    with pytest.raises(PolicyError, match="unknown"):
        make_policy(3)
    with torch.no_grad(), attach(model, policy, prompt_len=50):
        with pytest.raises(ValueError, match="prompt_len=50: beyond the sequence of 12"):
            model(ids)
    with torch.no_grad(), attach(model, policy, mode="real") as h:
        with pytest.raises(ValueError, match="needs a cache"):
            model(ids)
        with pytest.raises(PolicyError, match="needs a cache"):
            model.generate(ids, max_new_tokens=2, do_sample=False)
        cache = h.new_cache()
        model.generate(ids, cache=cache, max_new_tokens=2, do_sample=False)
        with pytest.raises(PolicyError, match="single-use"):
            model.generate(ids, cache=cache, max_new_tokens=2, do_sample=False)
    assert "generate" not in vars(model)  # the class's own generate again


# ------------------------------------------------------------------------------------------------ NaN/inf
@pytest.mark.parametrize("mode", ["simulated", "real"])
def test_non_finite_outside_attention_stops_before_sampling(tiny, mode):
    """inf from the last MLP (not attention): both paths stop with the token named, generate before sampling."""
    from h2o import attach, make_policy

    model, _ = tiny
    ids = torch.randint(3, 200, (1, 12), generator=torch.Generator().manual_seed(1))
    mlp = model.model.layers[-1].mlp
    hook = mlp.register_forward_hook(lambda m, i, out: out.index_fill(1, torch.tensor([min(7, out.shape[1] - 1)]),
                                                                          float("inf")))
    try:
        with torch.no_grad(), attach(model, make_policy("h2o", budget=0.5), mode=mode) as h:
            kw = {"cache": h.new_cache()} if mode == "real" else {}
            with pytest.raises(FloatingPointError, match="outside attention.* at token 7 "):
                model(ids, **kw)
        if mode == "real":
            with torch.no_grad(), attach(model, make_policy("h2o", budget=0.5), mode=mode) as h:
                with pytest.raises(FloatingPointError, match="stopped before sampling"):
                    model.generate(ids, cache=h.new_cache(), max_new_tokens=3, do_sample=True)
    finally:
        hook.remove()


# ------------------------------------------------------------------------------------------ sweep folders
def test_each_sweep_process_has_its_own_folder_and_summary(tmp_path, monkeypatch, capsys):
    from h2o.pipeline.run import main

    monkeypatch.chdir(tmp_path)
    runs = f"runs_dir={tmp_path}/runs"
    assert main(["-m", *TINY, *PPL, runs, "seed=0,1"]) == 0
    assert main(["-m", *TINY, *PPL, runs, "seed=0,1"]) == 0  # same second or not: a folder of its own
    folders = sorted((tmp_path / "multirun" / "adhoc").iterdir())
    assert len(folders) == 2 and all(len(read_jsonl(f / "jobs.jsonl")) == 2 for f in folders)
    # two sweeps forced into one folder: each summary counts only its own jobs; a failure is only its sweep's
    shared = f"hydra.sweep.dir={tmp_path}/shared"
    with monkeypatch.context() as m:  # a job that fails while it runs, past every up-front check
        m.setattr("h2o.tasks.summarization.SummarizationTask.run", lambda *a, **k: 1 / 0)
        assert main(["-m", *TINY, runs, shared, "task=bb_xsum", "task.limit=1", "task.shots=1", "seed=3"]) == 1
    capsys.readouterr()
    assert main(["-m", *TINY, *PPL, runs, shared, "seed=0,1"]) == 0
    err = capsys.readouterr().err
    assert "0 done, 2 skipped, 0 served, 0 refused, 0 busy, 0 failed" in err and "FAILED" not in err
    assert len(read_jsonl(tmp_path / "shared" / "jobs.jsonl")) == 3
