"""Check a head against stock llama.cpp: lossless, and our chain's acceptance (issue 43, llama.cpp side).

    python scripts/llamacpp_check.py --setup      # once: llama.cpp's tools + a converter venv in .llamacpp (~5 min)
    python scripts/llamacpp_check.py              # the shipped SmolLM2 head on 8 MT-Bench first turns
    python scripts/llamacpp_check.py --llamacpp-dir PATH/vendor/llama.cpp --converter-python PATH/bin/python

llama.cpp is the one vendored in the llama-cpp-python 0.3.36 sdist (its `vendor/llama.cpp` drafts with
DFlash heads: `llama-speculative-simple --spec-type draft-dflash`). What it does, in order:
1. `--setup`: downloads that sdist with pip into `--build-dir` (default `.llamacpp`), builds
   `llama-completion` and `llama-speculative-simple` with CMake (`-j2`), and creates a converter venv
   (`--system-site-packages`, plus this interpreter's site-packages and sentencepiece). Steps already
   done are skipped. `--llamacpp-dir` / `--converter-python` point at an existing tree and venv instead.
2. Writes the head for llama.cpp (`jetflow-export --format llamacpp`) and converts it and the target's HF
   folder to float32 GGUFs with llama.cpp's own `convert_hf_to_gguf.py` (both sides then run the weights
   the head was trained against, in float32).
3. Decodes the prompts here (torch, float32): the target's greedy tokens (AR) and our chain (width 1,
   `block_size - 1` draft tokens per round, what llama.cpp drafts), one prompt at a time.
4. Runs, per prompt, greedy (`--temp 0 --top-k 1 --seed 0 -nr -c 2048`): `llama-completion` (plain, with
   `--verbose-prompt`: it lists the prompt's token ids) and `llama-speculative-simple` with the head (`-v`:
   its debug log lists every round's draft ids and "accepted X/Y draft tokens, the last target token is
   (id)", from which the generated ids are rebuilt). `-nr`: this project's CPUs crash in llama.cpp's
   repacked weight buffers.
5. Checks, per prompt: llama.cpp tokenizes the prompt text (our ids, detokenized) to our ids exactly;
   llama.cpp's speculative token ids == our AR token ids (token level); llama.cpp's plain output ==
   its speculative output == our AR output as text (llama-completion prints text only, so these two are
   text level); our chain == our AR (token level); and the rebuilt ids reproduce both the speculative
   tool's printed text and its own n_predict / n_drafted / n_accept totals (the log was read right).
   Then acceptance: llama.cpp's mean acceptance length inside the allowed range below. Writes `--out`
   (JSON); exits 1 when a check fails, 2 (one `error:` line) when llama.cpp or the converter is missing or
   fails to run.

Acceptance is counted as vLLM counts it, `1 + accepted / drafts` over the rounds that drafted
(`serve.driver.spec_decode_counts`, which is also what counts llama.cpp's rounds here: budget = the
round's draft size Y, committed = X + 1). llama.cpp's `accept` line (accepted / drafted tokens) is a
different ratio and is not compared. Both sides count the rounds that start inside the first
`--max-tokens` tokens (a round that crosses the end counts whole, on both sides alike; ours decodes
exactly that many tokens). llama.cpp cuts a draft to `n_predict - emitted - 1` tokens, so it runs with
`-n max_tokens + block_size`, which leaves every counted round its full draft, and its tokens are
compared up to `--max-tokens`.

The allowed range, from what differs: llama.cpp's first round per prompt drafts from the prompt's last
token (before the target has produced anything), so the first generated token comes out of a drafted
round; ours comes out of the prefill, and our first draft is anchored on it. Every later round is
anchored the same way on both sides. Since a round commits its accepted tokens + 1,
`1 + A / D = N / D` with N the tokens the drafting rounds committed. So over m prompts llama.cpp's
drafting rounds commit N_o + m tokens (N_o = A_o + D_o: ours), in D_o + m drafts at most (the anchored
one comes on top of ours: exactly this when it accepts nothing, the rest then being our rounds one for
one; the JSON lists per prompt what it accepted and whether the remaining rounds match ours) and in
D_o - m at least (a draft per prompt fewer: the anchored draft's accepted tokens save a round later).
So llama.cpp's length must lie in [(N_o + m) / (D_o + m), (N_o + m) / (D_o - m)]: relative to ours, at most
m A_o / (N_o (D_o + m)) below and m (N_o + D_o) / (N_o (D_o - m)) above (0.24% and 3.5% on the default 8
prompts of 64 tokens at the shipped head's acceptance, 1.16). On top of that range, `--tolerance` (3%, as
in scripts/vllm_check.py) allows for kernel numerics: both sides are float32, but a near-tie of the head's
argmax can go the other way (seen once: 0.300 vs 0.298 for the top two tokens, llama.cpp taking the other
one and accepting it); a misread head moves acceptance by 8-14% (issue 43), outside it. The per-prompt
counts in the JSON say which prompt differed.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import re
import shutil
import site
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LLAMA_CPP_PYTHON = "0.3.36"
TOOLS = ("llama-completion", "llama-speculative-simple")


class SetupError(Exception):
    """llama.cpp, its build or the converter is missing or failed: exit 2 with one `error:` line."""


def _vllm_check():
    """`scripts/vllm_check.py` as a module (scripts/ is no package): its prompts and our decode."""
    spec = importlib.util.spec_from_file_location("vllm_check", REPO / "scripts" / "vllm_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", type=Path, default=REPO / "models" / "SmolLM2-135M-Instruct")
    p.add_argument("--head", type=Path, default=REPO / "heads" / "smollm2-135m-instruct")
    p.add_argument("--build-dir", type=Path, default=REPO / ".llamacpp", help="where --setup builds")
    p.add_argument("--setup", action="store_true", help="download and build llama.cpp into --build-dir")
    p.add_argument(
        "--llamacpp-dir", type=Path, default=None, help="an existing vendor/llama.cpp with build/bin"
    )
    p.add_argument("--converter-python", type=Path, default=None, help="a python that runs its converter")
    p.add_argument("--prompts", default="mtbench", help="a named prompt source (first turns are asked)")
    p.add_argument("--per-category", type=int, default=1, help="prompts per category of the source")
    p.add_argument(
        "--max-tokens", type=int, default=64, help="tokens compared (and whose rounds are counted)"
    )
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--tolerance", type=float, default=0.03, help="relative slack for numerics beyond the anchoring range"
    )
    p.add_argument("--timeout", type=int, default=600, help="seconds one llama.cpp run may take")
    p.add_argument("--workdir", type=Path, default=None, help="scratch folder (default: a temporary one)")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "llamacpp_interop.json")
    return p.parse_args(argv)


# --- setup -------------------------------------------------------------------------------------------


def _run(cmd: list[str], log: Path, what: str, **kwargs) -> None:
    with log.open("w") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, **kwargs)
    if proc.returncode != 0:
        raise SetupError(f"{what} failed with status {proc.returncode}; see {log}")


def sdist_tree(build_dir: Path) -> Path:
    return build_dir / f"llama_cpp_python-{LLAMA_CPP_PYTHON}" / "vendor" / "llama.cpp"


def setup_llamacpp(build_dir: Path) -> None:
    """Download, extract and build llama.cpp's two tools, and make the converter venv (skipping what is done)."""
    build_dir.mkdir(parents=True, exist_ok=True)
    sdist = build_dir / f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz"
    if sdist.exists():
        print(f"setup: {sdist.name} already downloaded")
    else:
        print(f"setup: downloading the llama-cpp-python=={LLAMA_CPP_PYTHON} sdist ...", flush=True)
        _run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"]
            + [f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "-d", str(build_dir)],
            build_dir / "download.log",
            "pip download",
        )
    tree = sdist_tree(build_dir)
    if (tree / "CMakeLists.txt").exists():
        print(f"setup: {tree} already extracted")
    else:
        print("setup: extracting ...", flush=True)
        with tarfile.open(sdist) as tar:
            tar.extractall(build_dir, filter="data")
    bindir = tree / "build" / "bin"
    if all((bindir / t).exists() for t in TOOLS):
        print(f"setup: {', '.join(TOOLS)} already built")
    else:
        if shutil.which("cmake") is None:
            raise SetupError("cmake is not installed (apt-get install cmake ninja-build)")
        gen = ["-G", "Ninja"] if shutil.which("ninja") else []
        flags = ["-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_SERVER=OFF"]
        flags += ["-DLLAMA_BUILD_APP=OFF", "-DLLAMA_OPENSSL=OFF", "-DGGML_CCACHE=OFF"]
        print("setup: configuring (cmake) ...", flush=True)
        _run(
            ["cmake", "-S", str(tree), "-B", str(tree / "build"), *gen, *flags],
            build_dir / "cmake.log",
            "cmake",
        )
        print("setup: building (-j2; about 4 minutes on 2 cores) ...", flush=True)
        t0 = time.perf_counter()
        _run(
            ["cmake", "--build", str(tree / "build"), "-j", "2", "--target", *TOOLS],
            build_dir / "build.log",
            "the llama.cpp build",
        )
        print(f"setup: built in {time.perf_counter() - t0:.0f} s")
    venv = build_dir / "venv"
    py = venv / "bin" / "python"
    if (
        py.exists()
        and subprocess.run([str(py), "-c", "import sentencepiece"], capture_output=True).returncode == 0
    ):
        print(f"setup: converter venv {venv} ready")
        return
    print("setup: converter venv (system site-packages + sentencepiece) ...", flush=True)
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    # the converter imports torch, numpy and transformers: this interpreter's, also when it is a venv
    purelib = subprocess.run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    (Path(purelib) / "jetflow_site.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    _run(
        [str(py), "-m", "pip", "install", "-q", "sentencepiece"],
        build_dir / "venv.log",
        "pip install sentencepiece",
    )


def resolve_tools(args: argparse.Namespace) -> tuple[Path, Path]:
    """(llama.cpp tree, converter python), or a SetupError saying what is missing."""
    tree = args.llamacpp_dir or sdist_tree(args.build_dir)
    missing = [t for t in TOOLS if not (tree / "build" / "bin" / t).exists()]
    if missing:
        raise SetupError(
            f"no {', '.join(missing)} under {tree}/build/bin: run with --setup (or --llamacpp-dir)"
        )
    if not (tree / "convert_hf_to_gguf.py").exists():
        raise SetupError(f"no convert_hf_to_gguf.py in {tree}")
    py = args.converter_python or args.build_dir / "venv" / "bin" / "python"
    if not py.exists():
        raise SetupError(f"no converter python at {py}: run with --setup (or --converter-python)")
    return tree, py


def llamacpp_version(tree: Path) -> str:
    out = subprocess.run(
        [str(tree / "build" / "bin" / "llama-completion"), "--version"], capture_output=True, text=True
    )
    m = re.search(r"version: .*", out.stdout + out.stderr)
    return m.group(0) if m else "unknown"


# --- conversion and runs -----------------------------------------------------------------------------


def convert(py: Path, tree: Path, src: Path, out: Path, log: Path, target: Path | None = None) -> None:
    cmd = [str(py), str(tree / "convert_hf_to_gguf.py"), str(src)]
    if target is not None:
        cmd += ["--target-model-dir", str(target)]
    _run([*cmd, "--outtype", "f32", "--outfile", str(out)], log, f"converting {src.name} to GGUF")


def run_tool(cmd: list[str], work: Path, tag: str, timeout: int) -> tuple[str, str, float]:
    """Run one llama.cpp tool; (stdout, stderr, seconds). Its output is kept as `work/<tag>.out|.err`."""
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, timeout=timeout)
    except subprocess.TimeoutExpired as err:
        raise SetupError(f"{Path(cmd[0]).name} ({tag}) ran past {timeout} s") from err
    seconds = time.perf_counter() - t0
    (work / f"{tag}.out").write_bytes(proc.stdout)
    (work / f"{tag}.err").write_bytes(proc.stderr)
    if proc.returncode != 0:
        raise SetupError(
            f"{Path(cmd[0]).name} ({tag}) failed with status {proc.returncode}; see {work}/{tag}.err"
        )
    return proc.stdout.decode("utf-8", "replace"), proc.stderr.decode("utf-8", "replace"), seconds


def prompt_token_ids(log: str) -> list[int]:
    """The ids `llama-completion --verbose-prompt` lists ("number of tokens in prompt = N", then N lines
    "  id -> 'piece'"; a piece may span lines, which do not start with a log prefix)."""
    m = re.search(r"number of tokens in prompt = (\d+)\n", log)
    if m is None:
        return []
    ids = re.findall(r"^[\d.]+ I +(\d+) -> '", log[m.end() :], flags=re.M)
    return [int(i) for i in ids[: int(m.group(1))]]


_DRAFT = re.compile(r"draft candidate +0, pos +\d+: +(\d+) \(")
_ROUND = re.compile(r"accepted (\d+)/(\d+) draft tokens, the last target token is: \((\d+)\)")
_TOTAL = re.compile(r"(n_predict|n_drafted|n_accept) += (\d+)")


def spec_rounds(log: str) -> list[dict]:
    """Every round of `llama-speculative-simple -v`: its draft ids (candidate 0 per position, logged before
    any cut, so the first Y are the draft), accepted X of Y, and the last target token."""
    rounds, draft, pos = [], [], 0
    for m in re.finditer(f"{_DRAFT.pattern}|{_ROUND.pattern}", log):
        if m.group(1) is not None:
            draft.append(int(m.group(1)))
            continue
        x, y, last = int(m.group(2)), int(m.group(3)), int(m.group(4))
        rounds.append({"start": pos, "accepted": x, "drafted": y, "draft": draft[:y], "last": last})
        pos += x + 1
        draft = []
    return rounds


def rebuild_tokens(rounds: list[dict], eos: set[int]) -> list[int]:
    """The generated ids: per round the accepted draft ids, then the target's own token; the tool stops
    at an end-of-generation token (then the logged last token is that one)."""
    out: list[int] = []
    for r in rounds:
        for t in [*r["draft"][: r["accepted"]], r["last"]]:
            out.append(t)
            if t in eos:
                return out
    return out


def completion_text(stdout: str) -> str:
    """What `llama-completion --no-display-prompt` generated: its stdout less the closing "\\n\\n" and the
    " [end of text]\\n" it prints at an end-of-generation token."""
    text = stdout.removesuffix("\n\n")
    return text.removesuffix(" [end of text]\n")


# --- main --------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if args.setup:
            setup_llamacpp(args.build_dir)
        tree, conv_py = resolve_tools(args)
    except SetupError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    try:
        return check(args, tree, conv_py, argv)
    except SetupError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


def check(args: argparse.Namespace, tree: Path, conv_py: Path, argv: list[str] | None) -> int:
    from dataclasses import asdict

    from export.engine_folder import EngineFolderSettings, write_engine_folder
    from jetflow_pl.decode_options import load_tokenizer
    from jetflow_pl.serve.driver import SpecDecodeCounts, spec_decode_counts

    vc = _vllm_check()
    t_start = time.perf_counter()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="llamacpp_check_"))
    work.mkdir(parents=True, exist_ok=True)
    bindir = tree / "build" / "bin"
    head_cfg = json.loads((args.head / "config.json").read_text())
    block_size = int(head_cfg.get("block_size", 16))
    k = block_size - 1
    T = args.max_tokens

    print(f"exporting the head for llama.cpp and converting it and the target to f32 GGUF in {work} ...")
    head_dir, head_gguf, target_gguf = (
        work / "head-llamacpp",
        work / "head-f32.gguf",
        work / "target-f32.gguf",
    )
    write_engine_folder(EngineFolderSettings(args.head, args.target, head_dir, "llamacpp", overwrite=True))
    t0 = time.perf_counter()
    convert(conv_py, tree, head_dir, head_gguf, work / "convert_head.log", target=args.target)
    convert(conv_py, tree, args.target, target_gguf, work / "convert_target.log")
    convert_seconds = time.perf_counter() - t0

    tokenizer = load_tokenizer(args.target)
    prompts = vc.prompt_ids(args.prompts, args.per_category, tokenizer)
    eos_cfg = json.loads((args.target / "config.json").read_text()).get("eos_token_id")
    eos = set(eos_cfg if isinstance(eos_cfg, list) else [eos_cfg]) - {None}

    def text(ids: list[int]) -> str:
        ids = ids[:-1] if ids and ids[-1] in eos else ids  # llama.cpp prints no end-of-generation token
        return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    print(f"{len(prompts)} prompts from {args.prompts}; decoding here (AR, chain of {k}), {T} tokens each")
    t0 = time.perf_counter()
    ours_args = argparse.Namespace(**{**vars(args), "tree_budgets": []})
    ours = [vc.decode_here(ours_args, [p], block_size) for p in prompts]
    ours_seconds = time.perf_counter() - t0

    common = ["--temp", "0", "--top-k", "1", "--seed", "0", "-nr", "-c", "2048", "-t", str(args.threads)]
    per_prompt, ll_counts, our_counts = [], SpecDecodeCounts(), SpecDecodeCounts()
    ll_seconds = {"plain": 0.0, "spec": 0.0}
    for i, (p, o) in enumerate(zip(prompts, ours, strict=True)):
        prompt_text = tokenizer.decode(
            p["ids"], skip_special_tokens=False, clean_up_tokenization_spaces=False
        )
        pfile = work / f"prompt{i}.txt"
        pfile.write_text(prompt_text + "\n")  # -f drops one trailing newline; the chat prompt ends in one
        print(
            f"  prompt {i} ({p['category']}, {len(p['ids'])} tokens): llama.cpp plain + speculative ...",
            flush=True,
        )
        out_a, err_a, s_a = run_tool(
            [str(bindir / "llama-completion"), "-m", str(target_gguf), "-f", str(pfile), "-n", str(T)]
            + [*common, "-no-cnv", "--verbose-prompt", "--no-display-prompt"],
            work,
            f"plain{i}",
            args.timeout,
        )
        out_s, err_s, s_s = run_tool(
            [str(bindir / "llama-speculative-simple"), "-m", str(target_gguf), "-md", str(head_gguf)]
            + ["--spec-type", "draft-dflash", "--spec-draft-n-max", str(k), "--spec-draft-p-min", "0"]
            + ["-f", str(pfile), "-n", str(T + block_size), *common, "-td", str(args.threads), "-v"],
            work,
            f"spec{i}",
            args.timeout,
        )
        ll_seconds["plain"] += s_a
        ll_seconds["spec"] += s_s
        rounds = spec_rounds(err_s)
        spec_ids = rebuild_tokens(rounds, eos)
        totals = {key: int(v) for key, v in _TOTAL.findall(err_s)}
        log_ok = (
            bool(rounds)
            and out_s == "\n\n" + prompt_text + text(spec_ids) + "\n\n\n\n"  # it ends with two "\n\n"
            and totals.get("n_predict") == sum(r["accepted"] + 1 for r in rounds)
            and totals.get("n_drafted") == sum(r["drafted"] for r in rounds)
            and totals.get("n_accept") == sum(r["accepted"] for r in rounds)
        )
        counted = [r for r in rounds if r["start"] < T]
        ll = spec_decode_counts([r["drafted"] for r in counted], [r["accepted"] + 1 for r in counted])
        ll_counts.add(ll)
        our_counts.add(o["chain"])
        ar, chain = o["ar_tokens"][0], o["chain_tokens"][0]
        ll_ar_text = completion_text(out_a)
        # with the anchored round accepting nothing, the rounds after it are ours one for one
        rest = spec_decode_counts(
            [r["drafted"] for r in counted[1:]], [r["accepted"] + 1 for r in counted[1:]]
        )
        per_prompt.append(
            {
                "id": p["id"],
                "category": p["category"],
                "prompt_tokens": len(p["ids"]),
                "prompt_ids_match": prompt_token_ids(err_a) == p["ids"],
                "llamacpp_spec_equals_our_ar": spec_ids[:T] == ar,  # token ids
                "llamacpp_spec_equals_llamacpp_plain": text(spec_ids[:T]) == ll_ar_text,  # text
                "llamacpp_plain_equals_our_ar": ll_ar_text == text(ar),  # text
                "our_chain_equals_our_ar": chain == ar,  # token ids
                "spec_log_consistent": log_ok,
                "tokens": len(ar),
                "llamacpp": {"num_drafts": ll.num_drafts, "num_accepted_tokens": ll.num_accepted_tokens},
                "ours": {
                    "num_drafts": o["chain"].num_drafts,
                    "num_accepted_tokens": o["chain"].num_accepted_tokens,
                },
                "anchored_draft_accepted": counted[0]["accepted"] if counted else None,
                "later_rounds_match_ours": (rest.num_drafts, rest.num_accepted_tokens)
                == (o["chain"].num_drafts, o["chain"].num_accepted_tokens),
            }
        )

    checks = ("prompt_ids_match", "llamacpp_spec_equals_our_ar", "llamacpp_spec_equals_llamacpp_plain")
    checks += ("llamacpp_plain_equals_our_ar", "our_chain_equals_our_ar", "spec_log_consistent")
    lossless = all(r[c] for r in per_prompt for c in checks)
    ll_c, our_c = asdict(ll_counts), asdict(our_counts)
    mal = vc.mean_acceptance_length
    ll_len, our_len = mal(ll_c), mal(our_c)
    m, d_o = len(prompts), our_c["num_drafts"]
    n_o = our_c["num_accepted_tokens"] + d_o
    lo = (n_o + m) / (d_o + m) * (1 - args.tolerance)
    hi = (n_o + m) / (d_o - m) * (1 + args.tolerance) if d_o > m else float("inf")
    gap = (ll_len - our_len) / our_len
    tol_below, tol_above = (our_len - lo) / our_len, (hi - our_len) / our_len
    in_range = lo <= ll_len <= hi

    def per_pos(c: dict) -> list[float]:
        return [n / c["num_drafts"] for n in c["accepted_per_pos"]] if c["num_drafts"] else []

    result = {
        "what": "stock llama.cpp (llama-cpp-python's vendored tree, CPU) drafting with the head exported by "
        "jetflow-export --format llamacpp, both converted to f32 GGUF",
        "when": time.strftime("%Y-%m-%d %H:%M"),
        "command": "python scripts/llamacpp_check.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": {"cpu": platform.processor() or platform.machine(), "threads": args.threads},
        "llamacpp_version": f"llama-cpp-python {LLAMA_CPP_PYTHON} sdist, vendor/llama.cpp {llamacpp_version(tree)}",
        "target": str(args.target),
        "head": str(args.head),
        "prompts": {"source": args.prompts, "per_category": args.per_category, "n": len(prompts)},
        "max_tokens": T,
        "num_speculative_tokens": k,
        "llamacpp_n_predict": T + block_size,
        "compared": {
            "prompt_ids_match": "token ids (llama-completion --verbose-prompt)",
            "llamacpp_spec_equals_our_ar": "token ids (rebuilt from llama-speculative-simple -v)",
            "llamacpp_spec_equals_llamacpp_plain": "text (llama-completion prints text only)",
            "llamacpp_plain_equals_our_ar": "text (ours detokenized by the HF tokenizer)",
            "our_chain_equals_our_ar": "token ids",
            "spec_log_consistent": "rebuilt ids reproduce the tool's printed text and its n_predict, "
            "n_drafted, n_accept totals",
        },
        "lossless": lossless,
        "per_prompt": per_prompt,
        "llamacpp": {
            **ll_c,
            "mean_acceptance_length": ll_len,
            "acceptance_per_pos": per_pos(ll_c),
            "seconds_with_head": ll_seconds["spec"],
            "seconds_without": ll_seconds["plain"],
        },
        "our_chain": {**our_c, "mean_acceptance_length": our_len, "acceptance_per_pos": per_pos(our_c)},
        "acceptance_gap": gap,
        "allowed_range": [lo, hi],
        "tolerance": tol_below if gap < 0 else tol_above,
        "tolerance_below_above": [tol_below, tol_above],
        "seconds": {
            "convert": convert_seconds,
            "ours": ours_seconds,
            "total": time.perf_counter() - t_start,
        },
        "passed": lossless and in_range,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    n = len(prompts)

    def count(c: str) -> str:
        return f"{sum(r[c] for r in per_prompt)}/{n}"

    aligned = [r for r in per_prompt if r["anchored_draft_accepted"] == 0]
    print(
        f"lossless: {lossless} (prompt ids {count('prompt_ids_match')}; llama.cpp spec == our AR "
        f"{count('llamacpp_spec_equals_our_ar')} tokens, == llama.cpp plain {count('llamacpp_spec_equals_llamacpp_plain')}"
        f" text; plain == our AR {count('llamacpp_plain_equals_our_ar')} text; our chain == AR "
        f"{count('our_chain_equals_our_ar')}; spec log read {count('spec_log_consistent')})\n"
        f"mean acceptance length: llama.cpp {ll_len:.4f} ({ll_c['num_accepted_tokens']}/{ll_c['num_drafts']}), "
        f"our chain {our_len:.4f} ({our_c['num_accepted_tokens']}/{our_c['num_drafts']}); gap {gap:+.2%}, "
        f"allowed {-tol_below:+.2%} .. {tol_above:+.2%}; anchored drafts accepting nothing on {len(aligned)}/{n}"
        f" prompts, later rounds == ours on {sum(r['later_rounds_match_ours'] for r in aligned)} of them\n"
        f"written: {args.out}"
    )
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
