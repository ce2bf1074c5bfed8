"""Long-context lengths too short for a task's fixed text are refused before the model loads, judged with the
model's tokenizer: niah's own docs (h2o.tasks.niah.shortest against the builder) and lm-eval's RULER samples
(h2o.tasks.ruler_offline.shortest_length against lm-eval's own generator)."""
from __future__ import annotations

import pytest

from h2o.tasks.niah import docs, shortest
from tests.refusal import refusal


@pytest.fixture(scope="module")
def tiny_tok():
    from transformers import AutoTokenizer

    from h2o.assets.tiny import tiny_checkpoint

    path = str(tiny_checkpoint("llama"))
    return path, AutoTokenizer.from_pretrained(path)


def test_niah_check_agrees_with_the_builder_at_the_threshold(tiny_tok):
    """Exactly the lengths whose docs the builder refuses are found too short, and the least length named is the
    first one the builder takes for that length's draw."""
    from h2o.tasks.niah import book, sample

    path, tok = tiny_tok
    words = book("austen")
    depths, samples = [0.0, 0.5, 1.0], 2
    first = shortest(tok, [50], depths, samples)
    assert first[0] == 50 and 300 < first[1] < 500  # one token per byte: the instruction, needle and question
    verdicts = []
    for n in range(first[1] - 12, first[1] + 12):
        short = shortest(tok, [n], depths, samples)
        try:
            [sample(tok, words, n, d, i, 0) for d in depths for i in range(samples)]
            built = True
        except ValueError as exc:
            assert "too short" in str(exc)
            built = False
        assert built == (short is None), n
        assert short is None or short == (n, short[1]) and short[1] > n
        verdicts.append(built)
    assert not verdicts[0] and verdicts[-1]  # the range holds the threshold
    assert shortest(tok, [1024, 50], depths, samples)[0] == 50
    assert len(docs(path, [first[1] + 20], [0.5], 1)) == 1


def test_ruler_bound_is_where_lm_eval_itself_gives_up(tiny_tok):
    """Below the bound lm-eval's own niah_single_1 cannot build a single sample; a little above it, it can."""
    from h2o.tasks.ruler_offline import shortest_length, use_haystack

    _, tok = tiny_tok
    use_haystack("austen")
    from lm_eval.tasks.ruler import niah_utils, prepare_niah

    need = shortest_length(tok, "niah_single_1")
    # the template, the needle sentence and the 128 tokens lm-eval sizes generation with (one token per byte here)
    assert 400 < need < 520

    def build(n: int) -> list[dict]:  # niah_single_1's own call, 8 samples instead of its 500 (time)
        return prepare_niah.generate_samples(prepare_niah.get_haystack("repeat"), max_seq_length=n,
                                             template=niah_utils.TEMPLATE, type_haystack="repeat",
                                             type_needle_k="words", type_needle_v="numbers", num_samples=8,
                                             TOKENIZER=tok)

    with pytest.raises(ValueError, match="Could not generate any sample"):
        build(need - 1)
    rows = build(need + 100)  # room for the key (twice) and the number
    assert rows and all(r["length"] <= need + 100 for r in rows)
    assert shortest_length(tok, "niah_multikey_1") > need  # four needles in the essay haystack
    assert shortest_length(tok, "vt") is None  # tasks without a known shape are not checked


@pytest.mark.parametrize("args, words", [
    (["task=niah", "task.lengths=[40,1024]"], ["task.lengths=[40, 1024]", "40 tokens are too short",
                                              "instruction, needle and question"]),
    (["task=ruler_niah_multikey_1", "task.lengths=[300]"], ["task.lengths=[300]", "niah_multikey_1 prompt"]),
])
def test_too_short_lengths_exit_2_before_the_model_loads(args, words, capsys, tmp_path, monkeypatch):
    from h2o.assets import model_spec
    from h2o.pipeline.run import main

    monkeypatch.chdir(tmp_path)
    model_spec._LOADED.clear()
    assert main(["model=tiny-llama", "threads=1", *args]) == 2
    err = refusal(capsys)
    assert len(err.splitlines()) == 1 and all(w in err for w in words) and "allowed: lengths >= " in err, err
    assert not model_spec._LOADED and not (tmp_path / "runs").exists()
