"""`--model` by Hugging Face repo id from a local cache layout (no network), and *.bin checkpoints."""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tandem.hub import ModelSourceError, resolve_model

REPO_ID = "tandem-test/stories260K"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
PROMPT = "Once upon a time"


def make_hf_cache(hf_home: Path, model_dir: Path, repo_id: str = REPO_ID, commit: str = COMMIT) -> Path:
    """The layout huggingface_hub writes: blobs by content hash, a snapshot of symlinks, refs/main."""
    repo = hf_home / "hub" / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for f in sorted(model_dir.iterdir()):
        data = f.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / f.name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return snapshot


def test_resolve_model_from_cache_directory_and_errors(tmp_path, stories_dir) -> None:
    snapshot = make_hf_cache(tmp_path / "hf", stories_dir)
    cache = tmp_path / "hf" / "hub"
    assert resolve_model(REPO_ID, cache_dir=cache) == str(snapshot)
    assert resolve_model(REPO_ID, revision=COMMIT, cache_dir=cache) == str(snapshot)
    assert resolve_model(str(stories_dir)) == str(stories_dir.resolve())
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelSourceError, match=r"^--model .*empty: no config.json"):
        resolve_model(str(tmp_path / "empty"))
    with pytest.raises(ModelSourceError, match=r"^--model ./nope: no such directory"):
        resolve_model("./nope")


def test_uncached_repo_id_offline_names_the_flag(tmp_path, monkeypatch) -> None:
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ModelSourceError, match=r"^--model tandem-test/absent: not in the Hugging Face cache"):
        resolve_model("tandem-test/absent", cache_dir=tmp_path / "hub")


def test_uncached_repo_id_with_an_unreachable_hub_names_the_flag(tmp_path) -> None:
    """The hub cannot be reached (nothing listens at HF_ENDPOINT): one error naming the flag, no traceback
    of the HTTP library's own exception types."""
    # huggingface_hub retries a refused connection five times, backing off 1+2+4+8+8 s: the
    # retries run here as for a user, their sleeps do not (time.sleep is a no-op in the child).
    code = ("import sys, time; time.sleep = lambda _s: None\n"
            "from tandem.hub import ModelSourceError, resolve_model\n"
            "try:\n    resolve_model('nobody/no-such-model', cache_dir=sys.argv[1])\n"
            "except ModelSourceError as e:\n    print(e); sys.exit(3)\n")
    env = {**os.environ, "HF_ENDPOINT": "http://127.0.0.1:9", "HF_HUB_OFFLINE": "0", "HF_HUB_ETAG_TIMEOUT": "2",
           "HF_HUB_DOWNLOAD_TIMEOUT": "2"}
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "hub")], capture_output=True, text=True,
                          env=env, timeout=60, cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 3, done.stderr[-2000:]
    assert done.stdout.startswith("--model nobody/no-such-model: not cached, and fetching it failed")


def test_pytorch_bin_checkpoint_gives_the_same_tokens(tmp_path, stories_dir) -> None:
    import torch
    from safetensors.torch import load_file

    from engine import LLM
    from tandem.types import SamplingParams

    bin_dir = tmp_path / "bin"
    shutil.copytree(stories_dir, bin_dir)
    state = {}
    for f in bin_dir.glob("*.safetensors"):
        state.update(load_file(str(f)))
        f.unlink()
    (bin_dir / "model.safetensors.index.json").unlink(missing_ok=True)
    torch.save(state, bin_dir / "pytorch_model.bin")
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    by_safetensors = LLM(str(stories_dir), num_kv_blocks=64).generate([PROMPT], params)[0].token_ids
    by_bin = LLM(str(bin_dir), num_kv_blocks=64).generate([PROMPT], params)[0].token_ids
    assert by_bin == by_safetensors and len(by_bin) == 16


def test_up_serves_a_repo_id_from_the_cache_with_the_tokens_of_the_path(tmp_path, stories_dir) -> None:
    """`tandem up --model owner/name` (HF_HOME points at a cache layout, offline) serves the
    same greedy tokens as the offline engine over the directory."""
    from engine import LLM
    from entrypoints.cluster import free_port
    from tandem import Client
    from tandem.types import SamplingParams

    make_hf_cache(tmp_path / "hf", stories_dir)
    port = free_port()
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    env.pop("HF_HUB_CACHE", None)
    proc = subprocess.Popen([sys.executable, "-m", "entrypoints", "up", "--model", REPO_ID, "--colocated",
                             "--port", str(port), "--log-dir", str(tmp_path / "logs"), "--no-metrics"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        lines = []
        deadline = time.time() + 240
        for line in proc.stdout:
            lines.append(line)
            if "Tandem is up" in line or time.time() > deadline:
                break
        assert "Tandem is up" in lines[-1], "".join(lines[-30:])
        assert f"models--{REPO_ID.replace('/', '--')}/snapshots/{COMMIT}" in lines[-1]
        with Client(f"127.0.0.1:{port}") as client:
            served = client.generate(PROMPT, max_tokens=12, temperature=0.0, ignore_eos=True).token_ids
    finally:
        proc.terminate()
        proc.wait(60)
    offline = LLM(str(stories_dir), num_kv_blocks=64).generate(
        [PROMPT], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0].token_ids
    assert served == offline and len(served) == 12
