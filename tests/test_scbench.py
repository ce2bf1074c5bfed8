"""SCBench (h2o.tasks.scbench) on a stand-in of its own row format, the tiny random Llama: the prompt ids its
protocol builds, its scorers, full equal to each request answered with the whole context, the turns mode on one
cache, the record through h2o-run, and the data check; the hub's file is never read here."""
from __future__ import annotations

import json

import pytest
import torch

from h2o import attach, make_policy
from h2o.assets.paths import REPO
from h2o.core.validate import BadInput
from h2o.tasks.many_questions import answer_contexts, greedy
from h2o.tasks.scbench import SCBenchTask, any_label, choice, contains, missing, rouge_lsum, share_found

DATA = REPO / "tests" / "data" / "scbench" / "scbench_kv.jsonl"  # 2 contexts of SCBench's kv rows, 2 and 3 requests
ROWS = [json.loads(line) for line in DATA.read_text().splitlines()]
MAX_NEW = 6


@pytest.fixture(scope="module")
def tiny():
    from h2o.assets.model_spec import ModelSpec

    return ModelSpec("tiny-llama", "tiny:llama").load()


def test_scorers_are_scbench_s():
    assert contains("the value is c3d4.", "c3d4") == 1.0 and contains("C3D4", "c3d4") == 0.0
    assert share_found("VAR_A, var_c", ["var_a", "var_b", "var_c"]) == 0.67 and share_found("x", "x") == 1.0


def test_qa_choice_and_summary_score_as_scbench_s():
    """SCBench's compute_scores for qa_eng (InfiniteBench's longdialogue_qa_eng), choice_eng (longbook_choice_eng)
    and summary (ROUGE-Lsum F1), case by case."""
    assert any_label(" it was mr. bingley", ["Mr. Bingley", "Bingley"]) == 1.0 and any_label("Darcy", ["Bingley"]) == 0
    five = ["five", "C"]
    assert [choice(t, five) for t in ["C. five", "B", "five", "The answer is: C", "the answer is five.",
                                      "I think the option is B", "Surely C", "", "The answer is"]] == \
        [1, 0, 1, 1, 1, 0, 1, 0, 0]
    assert choice("hmm AB maybe", five) == 0.0  # "AB" is in "ABCD": SCBench's test reads it as the choice
    ref = "Jane Bennet married Mr. Bingley at Longbourn."
    assert rouge_lsum(ref, ref) == 1.0 and rouge_lsum("Elizabeth walked", ref) == 0.0
    # LCS "Jane married Mr. Bingley" = 4 tokens (rouge-score lower-cases and drops punctuation): P 4/5, R 4/7
    p, r = 4 / 5, 4 / 7
    assert rouge_lsum("Jane married Mr. Bingley yesterday", ref) == pytest.approx(2 * p * r / (p + r))


@pytest.mark.parametrize("mode", ["questions", "turns"])
def test_qa_and_choice_requests_are_scbench_s_queries(tiny, mode):
    _, tok = tiny
    folder = DATA.parent
    qa = SCBenchTask("scbench", subset="scbench_qa_eng", mode=mode, data_files=str(folder / "scbench_qa_eng.jsonl"))
    row = qa.rows()[0]
    doc = qa.doc(tok, row)
    head = "Read the book and answer the question. Be very concise in your answer.\n\n"
    assert doc["context"] == tok(head + row["context"]).input_ids
    assert doc["questions"][0] == tok("\n\nQuestion: Where did Elizabeth walk every morning?\nAnswer:",
                                      add_special_tokens=False).input_ids
    assert doc["targets"] == [["to the old mill"], ["Mr. Bingley", "Bingley"]]
    ch = SCBenchTask("scbench", subset="scbench_choice_eng", mode=mode,
                     data_files=str(folder / "scbench_choice_eng.jsonl"))
    doc = ch.doc(tok, ch.rows()[0])
    later = "The letter of the correct answer is" if mode == "turns" else "The the correct answer is"
    text = f"\n\nQuestion: Where was the wedding held?\nA. the old mill\nB. Longbourn church\nC. London\nD. " \
           f"Netherfield\n\n{later}"
    assert doc["questions"][1] == tok(text, add_special_tokens=False).input_ids
    assert doc["targets"] == [["five", "C"], ["Longbourn church", "B"]] and ch.gen_tokens == 40
    summary = SCBenchTask("scbench", subset="scbench_summary", data_files=str(folder / "scbench_summary.jsonl"))
    assert summary.gen_tokens == 200 and summary.doc(tok, summary.rows()[0])["context"] == tok(row["context"]).input_ids


def test_prompt_ids_and_middle_truncation(tiny):
    _, tok = tiny
    doc = SCBenchTask("scbench", data_files=str(DATA)).doc(tok, ROWS[0])
    text = "Extract the value corresponding to the specified key in the JSON object below.\n\n" + ROWS[0]["context"]
    assert doc["context"] == tok(text).input_ids and doc["targets"] == ["c3d4", "e1f2"]
    assert doc["questions"][1] == tok("\n\n" + ROWS[0]["multi_turns"][1]["input"], add_special_tokens=False).input_ids
    cut = SCBenchTask("scbench", data_files=str(DATA), max_context_tokens=11).doc(tok, ROWS[0])
    assert cut["context"] == doc["context"][:5] + doc["context"][-6:] and cut["fields"] == {"truncated": True}
    vt = SCBenchTask("scbench", subset="scbench_vt", data_files=str(DATA)).doc(tok, ROWS[0])
    assert vt["context"] == tok(ROWS[0]["context"]).input_ids  # no instruction: the context alone


def test_full_answers_each_request_as_the_whole_context_does(tiny):
    model, tok = tiny
    task = SCBenchTask("scbench", data_files=str(DATA), max_gen_toks=MAX_NEW)
    result = task.run(model, tok, make_policy("full"), "real", 0)
    assert [(s["doc_id"], s["question"]) for s in result.samples] == [(0, 0), (0, 1), (1, 0), (1, 1), (1, 2)]
    eos = tok.eos_token_id
    for s in result.samples:
        doc = task.doc(tok, ROWS[s["doc_id"]])
        with torch.no_grad(), attach(model, make_policy("full"), mode="real") as h:
            out = greedy(model, h.new_cache(), doc["context"] + doc["questions"][s["question"]], MAX_NEW,
                         lambda o: o[-1] == eos)
        assert s["generation"] == tok.decode(out, skip_special_tokens=True).strip()
        assert s["acc"] == float(s["target"] in s["generation"]) and s["target"] == doc["targets"][s["question"]]
    assert result.metrics["acc"] == sum(s["acc"] for s in result.samples) / 5
    assert result.info["questions"] == 3 and len(result.info["contexts"]) == 2 and result.info["subset"] == "scbench_kv"
    assert result.info["context_cap"] == model.config.max_position_embeddings - 2048  # null: the model's window
    # the same request twice in one context: the same answer (no request sees another's tokens)
    assert result.samples[3]["generation"] == result.samples[4]["generation"]


def test_turns_keep_one_cache_and_grow_it(tiny):
    model, tok = tiny
    task = SCBenchTask("scbench", mode="turns", data_files=str(DATA), max_gen_toks=MAX_NEW)
    result = task.run(model, tok, make_policy("full"), "real", 0)
    held = [s["kv_tokens_turn_end"] for s in result.samples]
    assert [s["turn"] for s in result.samples] == [0, 1, 0, 1, 2] and held[0] < held[1] and held[2] < held[3] < held[4]
    assert result.info["turns"] == 3
    # accuracy by turn over the contexts that have that turn (the first context has 2 requests, the second 3)
    docs = [task.doc(tok, row) for row in ROWS]
    right = {"c3d4", "ddcc"}  # turn 0 of context 0; turns 1 and 2 of context 1
    got = answer_contexts(model, tok, make_policy("full"), docs, "turns", 2, lambda out: False,
                          lambda text, target: float(target in right))
    assert [s["acc"] for s in got.samples] == [1.0, 0.0, 0.0, 1.0, 1.0]
    assert got.info["turn_acc"] == [0.5, 0.5, 1.0]


def test_through_h2o_run_with_its_record(tmp_path, monkeypatch):
    from h2o.pipeline.run import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("H2O_RUNS", raising=False)
    assert main(["model=tiny-llama", "threads=1", "task=scbench", f"task.data_files={DATA}",
                 f"task.max_gen_toks={MAX_NEW}", "policy=snapkv", "policy.budget=0.5", "policy.window=4"]) == 0
    (path,) = (tmp_path / "runs").rglob("metrics.json")
    rec = json.loads(path.read_text())
    samples = [json.loads(line) for line in (path.parent / "samples.jsonl").read_text().splitlines()]
    assert rec["task_kind"] == "shared_context" and rec["n_samples"] == 5 and len(samples) == 5
    assert rec["metrics"]["acc"] == sum(s["acc"] for s in samples) / 5
    assert rec["protocol"]["subset"] == "scbench_kv" and rec["protocol"]["mode"] == "questions"


def test_bad_values_and_missing_data_in_one_line(tmp_path, monkeypatch):
    with pytest.raises(BadInput, match=r"^task.subset='scbench_qa_chn': allowed: scbench_kv, scbench_prefix_suffix"):
        SCBenchTask("scbench", subset="scbench_qa_chn")
    with pytest.raises(BadInput, match=r"^task.mode='many': allowed: questions, turns$"):
        SCBenchTask("scbench", mode="many")
    with pytest.raises(BadInput, match=r"^task.data_files='/nonexistent.jsonl': no such file"):
        SCBenchTask("scbench", data_files="/nonexistent.jsonl")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))  # an empty cache: the hub's file is not here
    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    assert missing(SCBenchTask("scbench")) == ("hub data set microsoft/SCBench file data/scbench_kv.jsonl is not in "
                                               "the Hugging Face cache")
    with pytest.raises(BadInput, match=r"^task=scbench: its data are not on this machine \(hub data set"):
        SCBenchTask("scbench").check_data()


def test_the_cluster_grid_checks_each_subset_and_fits_the_model(tmp_path, monkeypatch, capsys):
    import huggingface_hub.constants as constants

    from h2o.assets.model_spec import ModelSpec
    from h2o.pipeline import prefetch

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    assert prefetch.main(["experiment=scbench_cluster", "policy=full", "--check"]) == 1
    lines = capsys.readouterr().out.strip().splitlines()
    assert [ln.split(":")[0] for ln in lines if ln.startswith("task")] == [
        "task scbench (scbench_kv)", "task scbench (scbench_prefix_suffix)", "task scbench (scbench_vt)",
        "task scbench (scbench_qa_eng)", "task scbench (scbench_choice_eng)", "task scbench (scbench_summary)"]
    qwen = ModelSpec("qwen3-8b", "Qwen/Qwen3-8B", positions=40960)
    SCBenchTask("scbench", max_context_tokens=32000).check_model(qwen)
    SCBenchTask("scbench").check_model(qwen)  # null: cut to its positions less the room for the requests
    with pytest.raises(BadInput, match=r"^task.max_context_tokens=40000: with 2048 tokens for the requests and "
                                       r"answers, .* allowed: null \(its positions less 2048\) or an int <= 38912$"):
        SCBenchTask("scbench", max_context_tokens=40000).check_model(qwen)
