"""The OpenAI-compatible HTTP API end to end, with the official `openai` package as the client,
against a gateway and real prefill + decode worker processes serving stories260K (its
tokenizer gets a simple chat template here): completions and chat completions, unary and
streaming, give the gRPC API's greedy text; n, logprobs, stop, seed, usage; 400 naming the
field, 404 for another model, 429 for a full tier, 503 with no worker; a disconnect mid-stream
frees every block on every worker; /health and /metrics on the HTTP port."""
from __future__ import annotations

import http.client
import json
import shutil
import threading
import urllib.request
from pathlib import Path

import openai
import pytest

from gateway.config import GatewayConfig, TierConfig, WorkerPoolConfig
from harness import GatewayThread, start_workers, stop_workers, wait_idle, wait_until
from tandem import Client, Tier, TandemError
from tandem.tokenizer import Tokenizer
from worker.faults import ENV_STEP_DELAY

WAIT = 60.0  # bound on waits for server-side events; never a timing assertion
LONG = 500  # tokens of a request meant to still be running when the test acts on it
# The decode worker's steps take 5 ms more (worker/faults.py), so LONG tokens take over 2 s on
# any machine, not the ~0.5 s stories260K needs here, while a test waits for the request to be
# seen running or queues others behind it.
STEP_DELAY_S = "0.005"
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}{{ m['content'] }}\n"
                 "{% elif m['role'] == 'user' %}User: {{ m['content'] }}\n{% else %}Assistant: {{ m['content'] }}\n"
                 "{% endif %}{% endfor %}{% if add_generation_prompt %}Assistant:{% endif %}")
MESSAGES = [{"role": "system", "content": "A short story."},
            {"role": "user", "content": "Tell me about Lily."},
            {"role": "assistant", "content": "Lily was a little girl."},
            {"role": "user", "content": "What did she do next?"}]


@pytest.fixture(scope="module")
def model_dir(stories_dir: Path, tmp_path_factory) -> Path:
    """stories260K with a chat template in its tokenizer_config.json."""
    out = tmp_path_factory.mktemp("stories-chat") / "stories260K"
    shutil.copytree(stories_dir, out)
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = CHAT_TEMPLATE
    cfg_path.write_text(json.dumps(cfg))
    return out


@pytest.fixture(scope="module")
def workers(model_dir: Path, tmp_path_factory):
    blocks = ["--num-kv-blocks", "128", "--max-running", "16"]
    ws = start_workers([("prefill", blocks), ("decode", blocks, {ENV_STEP_DELAY: STEP_DELAY_S})], model_dir,
                       tmp_path_factory.mktemp("http-workers"))
    yield ws
    stop_workers(ws)


def _gateway(model_dir: Path, workers, **kw) -> GatewayThread:
    pool = WorkerPoolConfig(prefill=(workers[0].address,), decode=(workers[1].address,),
                            **kw.pop("pool", {}))
    gw = GatewayThread(GatewayConfig(model_dir=str(model_dir), port=0, http_port=0, workers=pool, **kw))
    assert gw.wait_ready(WAIT)
    return gw


@pytest.fixture(scope="module")
def gateway(model_dir: Path, workers):
    gw = _gateway(model_dir, workers)
    yield gw
    gw.stop()


def base_url(gw: GatewayThread) -> str:
    return f"http://127.0.0.1:{gw.gateway.http_port}"


@pytest.fixture()
def oai(gateway: GatewayThread):
    with openai.OpenAI(base_url=base_url(gateway) + "/v1", api_key="unused", max_retries=0, timeout=WAIT) as c:
        yield c


@pytest.fixture()
def grpc_client(gateway: GatewayThread):
    with Client(gateway.target, timeout=WAIT) as c:
        yield c


def test_models_lists_the_served_model(oai: openai.OpenAI, model_dir: Path) -> None:
    models = oai.models.list().data
    assert [m.id for m in models] == [model_dir.name]


def test_completions_equal_grpc_greedy_unary_and_streaming(oai: openai.OpenAI, grpc_client: Client,
                                                           model_dir: Path) -> None:
    for prompt in ("Once upon a time", "The little dog"):
        want = grpc_client.generate(prompt, max_tokens=24, temperature=0.0)
        got = oai.completions.create(model=model_dir.name, prompt=prompt, max_tokens=24, temperature=0.0)
        assert got.choices[0].text == want.text and want.text
        assert got.choices[0].finish_reason == want.finish_reason
        assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (want.usage.prompt_tokens,
                                                                          want.usage.completion_tokens)
        chunks = list(oai.completions.create(model=model_dir.name, prompt=prompt, max_tokens=24, temperature=0.0,
                                             stream=True, stream_options={"include_usage": True}))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == want.text
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == want.finish_reason
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == want.usage.completion_tokens
    # token-id prompts too
    ids = Tokenizer.from_dir(model_dir).encode("Once upon a time")
    want = grpc_client.generate(ids, max_tokens=8, temperature=0.0)
    got = oai.completions.create(model=model_dir.name, prompt=ids, max_tokens=8, temperature=0.0)
    assert got.choices[0].text == want.text


def test_chat_completions_equal_grpc_greedy_on_the_templated_prompt(oai: openai.OpenAI, grpc_client: Client,
                                                                    model_dir: Path) -> None:
    tok = Tokenizer.from_dir(model_dir)
    rendered = tok.apply_chat_template(MESSAGES, add_generation_prompt=True)
    assert rendered.startswith("<s>A short story.\nUser: Tell me about Lily.\n") and rendered.endswith("Assistant:")
    want = grpc_client.generate(tok.encode(rendered, add_special_tokens=False), max_tokens=32, temperature=0.0)
    got = oai.chat.completions.create(model=model_dir.name, messages=MESSAGES, max_completion_tokens=32,
                                      temperature=0.0)
    msg = got.choices[0].message
    assert (msg.role, msg.content) == ("assistant", want.text) and want.text
    assert got.usage.prompt_tokens == want.usage.prompt_tokens
    chunks = list(oai.chat.completions.create(model=model_dir.name, messages=MESSAGES, max_tokens=32,
                                              temperature=0.0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.text
    assert chunks[-1].choices[0].finish_reason == want.finish_reason


def test_n_logprobs_stop_seed_and_extensions(oai: openai.OpenAI, grpc_client: Client, model_dir: Path) -> None:
    name = model_dir.name
    got = oai.completions.create(model=name, prompt=["Once upon a time", "The cat"], n=2, max_tokens=6,
                                 temperature=0.0, logprobs=2)
    assert [c.index for c in got.choices] == [0, 1, 2, 3]
    assert got.choices[0].text == got.choices[1].text != got.choices[2].text == got.choices[3].text
    lp = got.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == 6 and all(len(t) <= 2 for t in lp.top_logprobs)
    assert "".join(lp.tokens) == got.choices[0].text and lp.text_offset[0] == 0
    assert got.usage.completion_tokens == 24
    want = grpc_client.generate("Once upon a time", max_tokens=24, temperature=0.0).text
    stop = want[8:11]
    cut = oai.completions.create(model=name, prompt="Once upon a time", max_tokens=24, temperature=0.0, stop=[stop])
    assert cut.choices[0].text == want[:want.index(stop)] and cut.choices[0].finish_reason == "stop"
    sampled = [oai.chat.completions.create(model=name, messages=MESSAGES, max_tokens=12, temperature=1.0, seed=7,
                                           logprobs=True, top_logprobs=3).choices[0] for _ in range(2)]
    assert sampled[0].message.content == sampled[1].message.content
    assert len(sampled[0].logprobs.content) == 12 and len(sampled[0].logprobs.content[0].top_logprobs) == 3
    ext = oai.completions.create(model=name, prompt="Once", max_tokens=40, temperature=0.0,
                                 extra_body={"priority": "interactive", "ignore_eos": True, "top_k": 1,
                                             "repetition_penalty": 1.0, "min_p": 0.0})
    assert ext.usage.completion_tokens == 40 and ext.choices[0].finish_reason == "length"


@pytest.mark.parametrize("kwargs, param", [
    ({"temperature": -1.0}, "temperature"),
    ({"max_tokens": 100_000}, "max_tokens"),
    ({"top_p": 1.5}, "top_p"),
    ({"n": 0}, "n"),
    ({"logprobs": 99}, "logprobs"),
    ({"extra_body": {"priority": "urgent"}}, "priority"),
    ({"extra_body": {"top_k": -2}}, "top_k"),
    ({"prompt": ""}, "prompt"),
    ({"stop": ["x"] * 40}, "stop"),
])
def test_invalid_input_is_400_naming_the_field(oai: openai.OpenAI, model_dir: Path, kwargs: dict, param: str) -> None:
    kw = {"model": model_dir.name, "prompt": "hello", "max_tokens": 4, **kwargs}
    with pytest.raises(openai.BadRequestError) as info:
        oai.completions.create(**kw)
    assert info.value.status_code == 400
    assert info.value.body["param"] == param and param in info.value.body["message"], info.value.body
    assert info.value.body["type"] == "invalid_request_error"


def test_invalid_chat_and_unknown_model(oai: openai.OpenAI, model_dir: Path, gateway: GatewayThread) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(model=model_dir.name, messages=[{"role": "wizard", "content": "hi"}])
    assert info.value.body["param"] == "messages[0].role"
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(model=model_dir.name, messages=MESSAGES, top_logprobs=2)
    assert info.value.body["param"] == "top_logprobs"
    with pytest.raises(openai.NotFoundError) as missing:
        oai.completions.create(model="gpt-4o", prompt="hi")
    assert missing.value.body["param"] == "model" and missing.value.body["code"] == "model_not_found"
    conn = http.client.HTTPConnection("127.0.0.1", gateway.gateway.http_port, timeout=WAIT)
    conn.request("POST", "/v1/completions", body=b"{not json", headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 400 and "JSON" in json.loads(resp.read())["error"]["message"]
    conn.close()


def test_disconnect_mid_stream_frees_every_block_on_every_worker(gateway: GatewayThread, workers,
                                                                 model_dir: Path) -> None:
    body = json.dumps({"model": model_dir.name, "prompt": "Once upon a time", "max_tokens": LONG,
                       "ignore_eos": True, "temperature": 0.0, "stream": True}).encode()
    conn = http.client.HTTPConnection("127.0.0.1", gateway.gateway.http_port, timeout=WAIT)
    conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.getheader("content-type").startswith("text/event-stream")
    first = resp.readline()
    assert first.startswith(b"data: {")
    wait_until(lambda: workers[1].stats().running == 1, WAIT, what="the decode worker to run the request")
    conn.sock.close()  # the client goes away mid-stream
    conn.close()
    wait_until(lambda: gateway.call(lambda: not gateway.gateway.admission.running), WAIT, what="gateway to forget it")
    for w in workers:
        stats = wait_idle(w, WAIT)
        assert stats.free_kv_blocks == stats.total_kv_blocks
    # the same for a unary request whose client leaves before the answer
    body = json.dumps({"model": model_dir.name, "prompt": "Once", "max_tokens": LONG, "ignore_eos": True}).encode()
    conn = http.client.HTTPConnection("127.0.0.1", gateway.gateway.http_port, timeout=WAIT)
    conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
    wait_until(lambda: workers[1].stats().running == 1, WAIT, what="the decode worker to run the unary request")
    conn.sock.close()
    conn.close()
    wait_until(lambda: gateway.call(lambda: not gateway.gateway.admission.running), WAIT, what="gateway to forget it")
    for w in workers:
        wait_idle(w, WAIT)


def test_full_tier_is_429(model_dir: Path, workers) -> None:
    tiers = {Tier.INTERACTIVE: TierConfig(4), Tier.STANDARD: TierConfig(4), Tier.BATCH: TierConfig(1, 30.0)}
    gw = _gateway(model_dir, workers, tiers=tiers, pool={"max_inflight_per_decode": 1})
    try:
        with openai.OpenAI(base_url=base_url(gw) + "/v1", api_key="unused", max_retries=0, timeout=WAIT) as c:
            long = c.completions.create(model=model_dir.name, prompt="Once", max_tokens=LONG, stream=True,
                                        extra_body={"ignore_eos": True, "priority": "batch"})
            next(iter(long))  # occupies the only decode slot
            queued: list[object] = []
            t = threading.Thread(target=lambda: queued.append(c.completions.create(
                model=model_dir.name, prompt="Twice", max_tokens=2, extra_body={"priority": "batch"})))
            t.start()
            wait_until(lambda: gw.call(lambda: gw.gateway.dispatcher.queues.depth(Tier.BATCH)) == 1, WAIT,
                       what="the BATCH queue to fill")
            with pytest.raises(openai.RateLimitError) as full:
                c.completions.create(model=model_dir.name, prompt="Thrice", max_tokens=2,
                                     extra_body={"priority": "batch"})
            assert full.value.status_code == 429 and "BATCH" in full.value.body["message"]
            assert full.value.body["param"] == "priority"
            long.close()  # frees the slot: the queued request runs
            t.join(WAIT)
            assert queued and queued[0].choices[0].finish_reason in ("length", "stop")
        for w in workers:
            wait_idle(w, WAIT)
    finally:
        gw.stop()


def test_no_worker_is_503_and_health_says_so(model_dir: Path) -> None:
    from entrypoints.cluster import free_port

    pool = WorkerPoolConfig(decode=(f"127.0.0.1:{free_port()}",))  # nothing listens there
    gw = GatewayThread(GatewayConfig(model_dir=str(model_dir), port=0, http_port=0, workers=pool))
    try:
        with openai.OpenAI(base_url=base_url(gw) + "/v1", api_key="unused", max_retries=0, timeout=WAIT) as c:
            with pytest.raises(openai.InternalServerError) as info:
                c.completions.create(model=model_dir.name, prompt="hello", max_tokens=2)
        assert info.value.status_code == 503 and "no decode worker is up" in info.value.body["message"]
        with pytest.raises(urllib.error.HTTPError) as health:
            urllib.request.urlopen(base_url(gw) + "/health", timeout=WAIT)
        assert health.value.code == 503
        with pytest.raises(TandemError) as grpc_info:  # the same answer over gRPC: one admission
            Client(gw.target, timeout=WAIT).generate("hello", max_tokens=2)
        assert grpc_info.value.code.name == "UNAVAILABLE"
    finally:
        gw.stop()


def test_health_and_metrics_on_the_http_port(gateway: GatewayThread, oai: openai.OpenAI, model_dir: Path) -> None:
    assert urllib.request.urlopen(base_url(gateway) + "/health", timeout=WAIT).status == 200
    before = gateway.metric("tandem_gateway_generation_tokens_total")
    oai.completions.create(model=model_dir.name, prompt="count", max_tokens=5, extra_body={"ignore_eos": True})
    scraped = urllib.request.urlopen(base_url(gateway) + "/metrics", timeout=WAIT).read().decode()
    line = next(ln for ln in scraped.splitlines()
                if ln.startswith(("tandem_gateway_generation_tokens_total ", "tandem_gateway_generation_tokens_total{")))
    assert float(line.split()[-1]) == before + 5


def test_http_layer_imports_no_torch() -> None:
    import subprocess
    import sys

    code = "import sys, gateway.server, gateway.http.app; assert 'torch' not in sys.modules, 'torch imported'"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=WAIT,
                          cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 0, done.stderr


def _bench(argv: list[str]) -> int:
    from loadgen.command import main

    return main([*argv, "--no-progress"])


def test_bench_openai_backend_same_tokens_as_grpc_plots_and_baseline(gateway: GatewayThread, tmp_path: Path,
                                                                      capsys) -> None:
    common = ["--dataset", "random", "--num-requests", "6", "--input-len", "12:20", "--output-len", "6:10",
              "--concurrency", "1,3", "--warmup", "1", "--per-request", "--seed", "3"]
    grpc_out, http_out = tmp_path / "grpc.json", tmp_path / "http.json"
    assert _bench(["--target", gateway.target, "--out", str(grpc_out), *common]) == 0
    assert _bench(["--backend", "openai", "--target", base_url(gateway) + "/v1", "--out", str(http_out),
                   "--plot-dir", str(tmp_path / "plots"), *common]) == 0
    grpc_runs, http_runs = (json.loads(p.read_text()) for p in (grpc_out, http_out))
    assert len(grpc_runs["runs"]) == len(http_runs["runs"]) == 2

    def tokens(run: dict) -> list[tuple]:
        return sorted((r["conversation"], r["turn"], r["prompt_tokens"], r["completion_tokens"], r["status"])
                      for r in run["requests"])

    for g, h in zip(grpc_runs["runs"], http_runs["runs"]):
        assert tokens(g) == tokens(h) and all(t[4] == "OK" and t[3] >= 6 for t in tokens(h))
        assert g["summary"]["completion_tokens"] == h["summary"]["completion_tokens"] > 0
    # the record: date, model, version, command line
    assert http_runs["model"] == gateway.gateway.model.name and http_runs["backend"] == "openai"
    assert http_runs["date"][:2] == "20" and http_runs["version"]
    assert http_runs["command"].startswith("tandem bench --backend openai --target http://")
    # plots: PNGs that open, every axes titled with units on its labels
    from PIL import Image

    from loadgen.report import RequestResult, plot_figures

    pngs = sorted((tmp_path / "plots").glob("*.png"))
    assert [p.name for p in pngs] == ["latency_cdf.png", "sweep.png"]
    for p in pngs:
        with Image.open(p) as img:
            img.load()
            assert img.size[0] > 400 and gateway.gateway.model.name in img.text["Title"]
    results = [[RequestResult(r["conversation"], r["turn"], r["request_id"], r["start_s"], r["e2e_s"], r["ttft_s"],
                              r["itl_s"], r["prompt_tokens"], r["completion_tokens"]) for r in run["requests"]]
               for run in http_runs["runs"]]
    for _, fig in plot_figures(http_runs["runs"], results, "t"):
        for ax in fig.axes:
            assert ax.get_title() and "(" in ax.get_xlabel() and "(" in ax.get_ylabel(), ax
    # --baseline: a run passes against itself and fails, naming the metric, against one 30% faster
    capsys.readouterr()
    assert _bench(["--baseline", str(http_out), "--compare-only", str(http_out)]) == 0
    faster = json.loads(http_out.read_text())
    for run in faster["runs"]:
        s = run["summary"]
        s["output_token_throughput"] *= 1.3
        s["request_throughput"] *= 1.3
        for key in ("ttft_ms", "tpot_ms"):
            s[key] = {q: (v / 1.3 if isinstance(v, float) and q.startswith("p") else v) for q, v in s[key].items()}
    edited = tmp_path / "faster.json"
    edited.write_text(json.dumps(faster))
    assert _bench(["--baseline", str(edited), "--compare-only", str(http_out), "--tolerance", "10"]) == 3
    out = capsys.readouterr().out
    assert "regression:" in out and "output_token_throughput" in out and "ttft_p50_ms" in out
    # a live run with --baseline goes through the same check
    assert _bench(["--backend", "openai", "--target", base_url(gateway), "--baseline", str(http_out),
                   "--tolerance", "100000", *common]) == 0
    assert "against baseline" in capsys.readouterr().out


def test_gateway_process_and_tandem_up_take_http_port(model_dir: Path, workers, tmp_path: Path) -> None:
    import re
    import signal
    import subprocess

    from entrypoints.cluster import command
    from entrypoints.launcher import build_children
    from entrypoints.up_flags import parse_args

    gw = next(c for c in build_children(parse_args(["--http-port", "0"]), str(model_dir)) if c.role == "gateway")
    port = gw.argv[gw.argv.index("--http-port") + 1]
    assert int(port) > 0  # 0 is resolved to a fixed free port, so a restarted gateway keeps it
    out = tmp_path / "gateway.out"
    with open(out, "wb") as f:
        proc = subprocess.Popen(command("gateway", ["--model", str(model_dir), "--port", "0", "--http-port", "0",
                                                    "--prefill", workers[0].address, "--decode", workers[1].address,
                                                    "--log-level", "WARNING"]),
                                stdout=f, stderr=subprocess.STDOUT)
    try:
        line = wait_until(lambda: re.search(r"OpenAI-compatible HTTP on port (\d+)", out.read_text()), WAIT,
                          what="the gateway's banner")
        url = f"http://127.0.0.1:{line.group(1)}"
        wait_until(lambda: _status(url + "/health") == 200, WAIT, what="the gateway to see its workers")
        with openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=WAIT) as c:
            got = c.completions.create(model=model_dir.name, prompt="Once", max_tokens=4,
                                       extra_body={"ignore_eos": True})
        assert got.usage.completion_tokens == 4
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(WAIT) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "Traceback" not in out.read_text(), out.read_text()


def _status(url: str) -> int:
    try:
        return urllib.request.urlopen(url, timeout=WAIT).status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return 0


def test_openai_backend_closes_a_stream_left_early(gateway: GatewayThread) -> None:
    """A reader that leaves `OpenAIBackend.stream` before the last chunk leaves no suspended
    iteration behind: the chunk generator is closed with the context, not by the collector."""
    import asyncio

    from loadgen.backends import OpenAIBackend

    async def first_chunk_then_leave():
        async with OpenAIBackend(base_url(gateway) + "/v1") as backend:
            await backend.info(timeout=30)
            async with backend.stream("hello there", max_tokens=16, temperature=0.0, ignore_eos=True, seed=None,
                                      tier=Tier.STANDARD, request_id="leave-early", timeout=30) as chunks:
                first = await anext(chunks)
            return first, chunks.ag_frame is None  # before the loop's shutdown closes what is left

    first, closed = asyncio.run(first_chunk_then_leave())
    assert first.text or first.finish_reason
    assert closed  # closed with the context: nothing left for the collector to finalize
