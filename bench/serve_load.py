"""Load test of `jetflow-serve`: throughput and latency for AR vs fixed budgets vs `auto`, same batching.

    OMP_NUM_THREADS=1 python -m bench.serve_load --target data_gen/toy/assets/small \\
        --head data_gen/toy/assets/small_head --budgets 0 4 16 auto --concurrency 1 2 4 8 \\
        --requests 16 --max-tokens 48 --out bench/results/serve_load_toy.json

For each budget (0 = AR: the same server, engine and batching, no draft) it starts the server as users do
(`python -m jetflow_pl.serve ...` in a subprocess on 127.0.0.1, `--threads` torch threads), warms it up
(for `auto` that measures or loads this machine's cost profile), then for each concurrency level c runs
a closed loop: c client threads send `--requests` streamed greedy completions in all (prompt token ids
from `--prompts`, chat-formatted, cycled), each thread its next request as soon as its last one ended.
Per level: requests/s and completion tokens/s over the level's wall time, p50/p99 of request latency and
of time to first token; per budget, the server's own tau and mean draft budget played from /metrics. The bench stops by itself (a
fixed number of requests per level) and checks losslessness on the way: every request's greedy token ids
must equal the AR server's for the same prompt, or it stops with an error.

Writes the JSON to `--out` and, with matplotlib installed, a PNG beside it (throughput and p50/p99
latency vs concurrency, one line per budget).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import httpx

from bench.load_plot import budget_label, plot_load
from jetflow_pl.files import atomic_write_json

REPO = Path(__file__).resolve().parents[1]

DEFAULT_PROMPTS = REPO / "data_gen/toy/assets/heldout_prompts/math.jsonl"
MODEL = "bench"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """`python -m jetflow_pl.serve` in a subprocess, up until the context exits."""

    def __init__(self, args: argparse.Namespace, budget: str, log_dir: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "jetflow_pl.serve", "--target", str(args.target), "--budget", budget]
        if args.head is not None:
            cmd += ["--head", str(args.head)]
        if args.engine_dir is not None:
            cmd += ["--engine-dir", str(args.engine_dir), "--backend", args.backend or "onnxruntime"]
        elif args.backend:
            cmd += ["--backend", args.backend]
        cmd += ["--port", str(self.port), "--max-batch", str(args.max_batch), "--served-model-name", MODEL]
        cmd += ["--max-queue", str(max(args.concurrency) + 1), "--log-level", "warning"]
        cmd += ["--threads", str(args.threads)]  # torch's and, for an engine, ONNX Runtime's
        self.cmd = cmd
        self.log = log_dir / f"server_budget_{budget}.log"
        self.env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONPATH": str(REPO)}
        self.proc: subprocess.Popen | None = None
        self.startup_timeout = float(args.startup_timeout)

    def __enter__(self) -> Server:
        self._log = self.log.open("w")
        self.proc = subprocess.Popen(
            self.cmd, stdout=self._log, stderr=subprocess.STDOUT, env=self.env, cwd=REPO
        )
        deadline = time.monotonic() + self.startup_timeout
        while True:
            if self.proc.poll() is not None:
                self._fail(f"the server exited ({self.proc.returncode})")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self._fail(f"the server did not come up in {self.startup_timeout:.0f} s (--startup-timeout)")
            time.sleep(0.2)

    def _fail(self, why: str) -> None:
        """Stop the server (`__exit__` does not run when `__enter__` raises) and say why, with the end of
        its log (the log's folder is temporary)."""
        self.__exit__()
        tail = "".join(self.log.read_text(errors="replace").splitlines(keepends=True)[-15:])
        raise SystemExit(f"{why}; server command: {shlex.join(self.cmd)}; its log ends:\n{tail}")

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()

    def metric(self, name: str) -> float:
        for line in httpx.get(self.url + "/metrics", timeout=10).text.splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                return float(line.rsplit(" ", 1)[1])
        raise KeyError(name)


def one_request(client: httpx.Client, url: str, prompt: list[int], max_tokens: int) -> dict:
    """A streamed greedy completion: its token ids, latency and time to first token."""
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "return_token_ids": True,
    }
    t0 = time.perf_counter()
    ttft, ids = None, []
    with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise SystemExit(f"request failed: {r.status_code} {r.read()[:300]!r}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise SystemExit(f"request failed mid-stream: {chunk['error']}")
            new = chunk["choices"][0].get("token_ids") or []
            if new and ttft is None:
                ttft = time.perf_counter() - t0
            ids += new
    return {"ids": ids, "latency_s": time.perf_counter() - t0, "ttft_s": ttft or 0.0}


def run_level(url: str, prompts: list[list[int]], concurrency: int, requests: int, max_tokens: int) -> dict:
    """`requests` requests from `concurrency` closed-loop client threads; request i uses prompt i mod n."""
    results: list[dict | None] = [None] * requests
    nxt = iter(range(requests))
    lock = threading.Lock()

    def worker() -> None:
        with httpx.Client(timeout=600) as client:
            while True:
                with lock:
                    i = next(nxt, None)
                if i is None:
                    return
                res = one_request(client, url, prompts[i % len(prompts)], max_tokens)
                res["prompt"] = i % len(prompts)
                results[i] = res

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    done = [r for r in results if r is not None]
    if len(done) != requests:
        raise SystemExit(f"{requests - len(done)} requests did not finish")
    lat = sorted(r["latency_s"] for r in done)
    ttft = sorted(r["ttft_s"] for r in done)
    tokens = sum(len(r["ids"]) for r in done)
    return {
        "concurrency": concurrency,
        "requests": requests,
        "wall_s": wall,
        "requests_per_s": requests / wall,
        "tokens_per_s": tokens / wall,
        "completion_tokens": tokens,
        "latency_p50_s": percentile(lat, 50),
        "latency_p99_s": percentile(lat, 99),
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p99_s": percentile(ttft, 99),
        "_outputs": {r["prompt"]: r["ids"] for r in done},
    }


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (p99 of fewer than 100 samples is their maximum)."""
    if not sorted_values:
        return 0.0
    k = max(0, min(len(sorted_values) - 1, int(-(-q * len(sorted_values) // 100)) - 1))
    return float(sorted_values[k])


def plot(results: dict, out: Path) -> Path | None:
    series = {
        budget_label(budget): [
            {
                "x": lv["concurrency"],
                "tokens_per_s": lv["tokens_per_s"],
                "latency_p50_s": lv["latency_p50_s"],
                "latency_p99_s": lv["latency_p99_s"],
            }
            for lv in row["levels"]
        ]
        for budget, row in results["configs"].items()
    }
    s = results["settings"]
    title = (
        f"jetflow-serve load: {Path(s['target']).name}, {s['requests']} requests/level, {s['max_tokens']} max "
        f"tokens, max batch {s['max_batch']}, {s['threads']} thread(s)"
    )
    return plot_load(series, "concurrent clients", title, out)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", type=Path, required=True)
    p.add_argument("--head", type=Path, default=None)
    p.add_argument("--backend", default=None)
    p.add_argument("--engine-dir", type=Path, default=None)
    p.add_argument("--budgets", nargs="+", default=["0", "4", "16", "auto"], help="0 = AR; ints or auto")
    p.add_argument("--concurrency", nargs="+", type=int, default=[1, 2, 4, 8])
    p.add_argument("--requests", type=int, default=16, help="requests per concurrency level")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--threads", type=int, default=1, help="CPU threads of the server (torch, ONNX Runtime)")
    p.add_argument(
        "--startup-timeout",
        type=float,
        default=900,
        help="seconds a server may take to come up (with --budget auto it measures its cost profile first)",
    )
    p.add_argument("--prompts", type=Path, default=DEFAULT_PROMPTS, help="jsonl (prompt/messages) or .txt")
    p.add_argument("--n-prompts", type=int, default=16)
    p.add_argument("--no-chat-template", action="store_true")
    p.add_argument("--out", type=Path, default=REPO / "bench/results/serve_load.json")
    args = p.parse_args(argv)
    if "0" not in args.budgets:
        args.budgets = ["0", *args.budgets]  # AR is the reference of speed and of the tokens

    from bench.budget_auto import read_prompts  # the prompt files of the other benches
    from jetflow_pl.decode_options import load_tokenizer

    tok_dir = args.target if args.engine_dir is None else args.engine_dir / "tokenizer"
    prompts = read_prompts(args.prompts, load_tokenizer(tok_dir), args.n_prompts, not args.no_chat_template)
    results: dict = {
        "command": shlex.join(
            ["python", "-m", "bench.serve_load", *(argv if argv is not None else sys.argv[1:])]
        ),
        "machine": {
            "platform": platform.platform(),
            "python": sys.version.split()[0],
            "cpus": os.cpu_count(),
        },
        "settings": {
            "target": str(args.target),
            "head": str(args.head),
            "backend": args.backend or ("onnxruntime" if args.engine_dir else "torch"),
            "requests": args.requests,
            "max_tokens": args.max_tokens,
            "max_batch": args.max_batch,
            "threads": args.threads,
            "prompts": str(args.prompts),
            "n_prompts": len(prompts),
        },
        "configs": {},
    }
    reference: dict[int, list[int]] = {}
    with tempfile.TemporaryDirectory() as logs:
        for budget in args.budgets:
            with Server(args, budget, Path(logs)) as srv:
                results["settings"]["server_command"] = shlex.join(["python", *srv.cmd[1:]])
                with httpx.Client(timeout=600) as client:  # warm-up (auto: the cost profile, first)
                    for prompt in prompts[:2]:
                        one_request(client, srv.url, prompt, args.max_tokens)
                levels = []
                for c in args.concurrency:
                    level = run_level(srv.url, prompts, c, args.requests, args.max_tokens)
                    for i, ids in level.pop("_outputs").items():
                        if reference.setdefault(i, ids) != ids:
                            raise SystemExit(f"budget {budget}, concurrency {c}: prompt {i} differs from AR")
                    levels.append(level)
                    print(
                        f"budget {budget:>4} c={c:<3} {level['tokens_per_s']:8.1f} tok/s  "
                        f"p50 {level['latency_p50_s']:.3f}s  p99 {level['latency_p99_s']:.3f}s",
                        flush=True,
                    )
                results["configs"][budget] = {
                    "levels": levels,
                    "tau_mean": srv.metric("jetflow_tau_mean"),
                    "draft_budget_mean": srv.metric("jetflow_draft_budget_mean"),
                }
    ar = {lv["concurrency"]: lv["tokens_per_s"] for lv in results["configs"]["0"]["levels"]}
    results["speedup_vs_ar"] = {
        b: {str(lv["concurrency"]): lv["tokens_per_s"] / ar[lv["concurrency"]] for lv in row["levels"]}
        for b, row in results["configs"].items()
        if b != "0"
    }
    results["lossless"] = True  # every request's tokens equalled AR's (checked above)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(args.out, results)
    png = plot(results, args.out.with_suffix(".png"))
    print(f"wrote {args.out}" + (f" and {png}" if png else ""))
    for b, row in results["speedup_vs_ar"].items():
        print(f"budget {b}: x" + "  x".join(f"{v:.2f} (c={c})" for c, v in row.items()) + " vs AR")
    return 0


if __name__ == "__main__":
    sys.exit(main())
