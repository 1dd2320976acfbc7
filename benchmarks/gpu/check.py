"""The GPU check: speculative decoding on an NVIDIA GPU, measured without network (benchmarks/gpu/check.sh).

Needs: Linux, an NVIDIA GPU with its driver, CUDA's compiler (nvcc), cmake, a C++ compiler, Python 3 with
numpy (PyTorch's environment has it). Needs no network and not specops' own environment: llama.cpp is
built from a trimmed copy of the source specops already builds on CPU (the llama-cpp-python sdist's
``vendor/llama.cpp``, without its bundled models, docs and tests: ``pack`` makes it, well under 64 MiB),
the models are generated here (gguf-py from that source + numpy), and llama-server is driven over HTTP.

Steps of ``run`` (each timed; ``--budget`` bounds the measurements):

1. build ``llama-server`` with ``-DGGML_CUDA=ON`` for this GPU (``CMAKE_CUDA_ARCHITECTURES=native``);
2. generate the layer-skip pair of a realistic size (default 2048 × 16 layers, ≈ 0.8 B parameters, random
   weights; specops/devenv/testmodels/gguf_models.py): layers 1.. of the target pass the residual stream
   unchanged (their compute is paid), the draft is its layer 0 alone, so the draft agrees with the target
   at ≈ 1/16 of its cost: what speculative decoding is for;
3. speedup vs k at c = 1: the target alone and with the draft at k = 2, 4, 8, greedy, fixed output length
   (``ignore_eos``), medians of ``--reps`` requests, both servers up at once and requests alternating;
4. the goodput surface: output tokens/s of both at c = 1, 2, 4, 8, 16, 32 (the best k);
5. the switch cost: the time from stopping the speculating server to its replacement (method none)
   answering (what a fallback costs, engine side), median of ``--switches``.

It writes one JSON (``--out``); ``table RESULTS.json`` prints the README's GPU table from it.

    python3 benchmarks/gpu/check.py pack --sdist ~/.cache/specops/engines/downloads/llama_cpp_python-0.3.36.tar.gz
    bash benchmarks/gpu/check.sh --src benchmarks/gpu/llama.cpp-src.tar.gz --out gpu-results.json
    python3 benchmarks/gpu/check.py table gpu-results.json
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tarfile
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
GENERATOR = ROOT / "specops" / "devenv" / "testmodels" / "gguf_models.py"
DEFAULT_SRC = HERE / "llama.cpp-src.tar.gz"
#: What the trimmed source leaves out of vendor/llama.cpp (not needed to build llama-server).
TRIM = ("models", "docs", "media", "benches", "tests", ".github", "examples/model-conversion")
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_CUDA=ON",
    "-DGGML_RPC=ON",
    "-DCMAKE_CUDA_ARCHITECTURES=native",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
)
KS = (2, 4, 8)
LEVELS = (1, 2, 4, 8, 16, 32)
PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n    return"


def say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------- pack


def pack(sdist: Path, out: Path) -> dict:
    """The sdist's vendor/llama.cpp without :data:`TRIM`, as ``out`` (a .tar.gz rooted at ``llama.cpp/``)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    kept = 0
    with tarfile.open(sdist) as src, tarfile.open(out, "w:gz", compresslevel=9) as dst:
        for member in src.getmembers():
            parts = member.name.split("/")
            if len(parts) < 3 or parts[1:3] != ["vendor", "llama.cpp"]:
                continue
            rel = "/".join(parts[3:])
            if not rel or any(rel == t or rel.startswith(t + "/") for t in TRIM):
                continue
            if not (member.isfile() or member.isdir()):
                continue
            member.name = "llama.cpp/" + rel
            dst.addfile(member, src.extractfile(member) if member.isfile() else None)
            kept += member.isfile()
    return {"out": str(out), "files": kept, "bytes": out.stat().st_size}


# ------------------------------------------------------------------------------------------- run


def _tool(argv: list[str]) -> str:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unavailable ({exc})"
    return (done.stdout + done.stderr).strip().splitlines()[-1] if done.returncode == 0 else "unavailable"


def preflight(gpu: bool = True) -> dict:
    """What this machine has; a missing GPU, nvcc or cmake stops the check with the reason (``gpu``)."""
    info = {
        "gpu": _tool(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"]),
        "nvcc": _tool(["nvcc", "--version"]),
        "cmake": _tool(["cmake", "--version"]).replace("cmake version ", ""),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
    }
    torch = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.__version__, torch.cuda.is_available())"],
        capture_output=True,
        text=True,
    )
    info["torch"] = torch.stdout.strip() or "not importable"
    for need in ("gpu", "nvcc") if gpu else ():
        if info[need].startswith("unavailable"):
            sys.exit(f"check: no {need} here ({info[need]}): this check needs an NVIDIA GPU and CUDA's compiler")
    if shutil.which("cmake") is None:
        sys.exit("check: no cmake on PATH")
    return info


def build(src: Path, work: Path, jobs: int) -> tuple[Path, float]:
    t0 = time.monotonic()
    tree = work / "src"
    if not (tree / "llama.cpp" / "CMakeLists.txt").exists():
        tree.mkdir(parents=True, exist_ok=True)
        with tarfile.open(src) as tf:
            tf.extractall(tree, filter="data") if hasattr(tarfile, "data_filter") else tf.extractall(tree)
    out = work / "build"
    subprocess.run(["cmake", "-S", str(tree / "llama.cpp"), "-B", str(out), *CMAKE_FLAGS], check=True)
    subprocess.run(["cmake", "--build", str(out), "--target", "llama-server", f"-j{jobs}"], check=True)
    return out / "bin" / "llama-server", time.monotonic() - t0


def models(work: Path, src_tree: Path, hidden: int, layers: int) -> tuple[dict, float]:
    t0 = time.monotonic()
    out = work / f"layerskip-{hidden}x{layers}"
    summary = out / "summary.json"
    if not summary.exists():
        heads, ffn = max(1, hidden // 64), max(64, round(hidden * 8 / 3 / 64) * 64)
        env = {**os.environ, "PYTHONPATH": str(src_tree / "llama.cpp" / "gguf-py")}
        done = subprocess.run(
            [sys.executable, "-c", RUN_GENERATOR, str(GENERATOR), "layerskip", str(out), "--hidden", str(hidden),
             "--layers", str(layers), "--heads", str(heads), "--ffn", str(ffn)],
            env=env, capture_output=True, text=True, check=True,
        )  # fmt: skip
        summary.write_text(done.stdout.strip().splitlines()[-1])
    return {**json.loads(summary.read_text()), "dir": str(out)}, time.monotonic() - t0


#: gguf-py imports PyYAML for model cards, which writing a model never reads: a PyTorch environment without
#: PyYAML gets an empty stand-in module.
RUN_GENERATOR = """import runpy, sys, types
try:
    import yaml
except ImportError:
    sys.modules["yaml"] = types.ModuleType("yaml")
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One llama-server on loopback, all layers on GPU 0."""

    #: ``-ngl``: every layer on the GPU ("0" for a CPU dry run).
    layers_on_gpu = "999"

    def __init__(self, exe: Path, target: Path, draft: Path | None, k: int, log: Path, parallel: int = 32):
        self.port = free_port()
        ngl = self.layers_on_gpu
        argv = [str(exe), "-m", str(target), "-ngl", ngl, "-c", str(512 * parallel), "-np", str(parallel)]
        argv += ["--host", "127.0.0.1", "--port", str(self.port), "--metrics"]
        if draft is not None:
            argv += ["-md", str(draft), "-ngld", ngl, "--spec-type", "draft-simple", "--spec-draft-n-max", str(k)]
        self.argv = argv
        self.log = open(log, "w")
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float = 180) -> float:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited ({self.proc.returncode}); see {self.log.name}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:  # noqa: S310 (loopback)
                    if r.status == 200:
                        return time.monotonic() - t0
            except OSError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"llama-server not ready within {timeout} s; see {self.log.name}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


def complete(url: str, tokens: int) -> tuple[float, dict]:
    """One greedy completion of ``tokens`` tokens → (seconds, the answer's timings)."""
    body = {"prompt": PROMPT, "n_predict": tokens, "temperature": 0, "ignore_eos": True, "cache_prompt": False}
    req = urllib.request.Request(url + "/completion", json.dumps(body).encode(), {"Content-Type": "application/json"})
    t0 = time.monotonic()
    with urllib.request.urlopen(req, timeout=300) as r:  # noqa: S310 (loopback)
        doc = json.loads(r.read())
    return time.monotonic() - t0, doc.get("timings") or {}


def tokens_per_s(url: str, clients: int, tokens: int, rounds: int) -> float:
    """Output tokens/s with ``clients`` concurrent requests, ``rounds`` each (wall clock)."""
    t0 = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        list(pool.map(lambda _: complete(url, tokens), range(clients * rounds)))
    return clients * rounds * tokens / (time.monotonic() - t0)


def run(args) -> dict:
    t_start = time.monotonic()
    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    result: dict = {"machine": preflight(gpu=not args.dry_run), "steps": {}, "dry_run": args.dry_run}
    say(f"GPU: {result['machine']['gpu']}")
    if args.llama_server:  # a build made already (or, with --dry-run, a CPU one: the steps without a GPU)
        exe, seconds = Path(args.llama_server), 0.0
        with tarfile.open(Path(args.src).resolve()) as tf:
            (work / "src").mkdir(exist_ok=True)
            tf.extractall(work / "src", members=[m for m in tf.getmembers() if "/gguf-py/" in m.name])
    else:
        exe, seconds = build(Path(args.src).resolve(), work, args.jobs)
    result["steps"]["build_s"] = round(seconds, 1)
    say(f"built {exe} in {seconds:.0f} s")
    pair, seconds = models(work, work / "src", args.hidden, args.layers)
    result["steps"]["models_s"] = round(seconds, 1)
    result["models"] = pair
    target, draft = Path(pair["dir"]) / "target.gguf", Path(pair["dir"]) / "draft.gguf"
    say(f"models: target {pair['target_params'] / 1e9:.2f} B parameters, draft {pair['draft_params'] / 1e9:.2f} B")
    deadline = time.monotonic() + args.budget
    if args.dry_run:
        Server.layers_on_gpu = "0"
    base = Server(exe, target, None, 0, work / "server-base.log")
    servers = {0: base}
    try:
        base.wait_ready()
        for k in KS:
            servers[k] = Server(exe, target, draft, k, work / f"server-k{k}.log")
            servers[k].wait_ready()
        for s in servers.values():  # warm-up
            complete(s.url, 16)
        # 3. speedup vs k at c = 1: alternate baseline and each k request by request
        per_k: dict[int, list[float]] = {k: [] for k in servers}
        accepted: dict[int, list[float]] = {k: [] for k in KS}
        for _ in range(args.reps):
            for k, s in servers.items():
                seconds, timings = complete(s.url, args.tokens)
                per_k[k].append(args.tokens / seconds)
                if k and timings.get("draft_n"):
                    accepted[k].append(timings.get("draft_n_accepted", 0) / timings["draft_n"])
            if time.monotonic() > deadline:
                break
        base_tps = statistics.median(per_k[0])
        result["speedup_vs_k"] = [
            {
                "k": k,
                "tokens_per_s": round(statistics.median(per_k[k]), 1),
                "speedup": round(statistics.median(per_k[k]) / base_tps, 3),
                "acceptance": round(statistics.median(accepted[k]), 3) if k and accepted[k] else None,
            }
            for k in servers
        ]
        best = max(KS, key=lambda k: statistics.median(per_k[k]))
        say(f"speedup vs k: {result['speedup_vs_k']}")
        # 4. the goodput surface at the best k
        surface = []
        for c in [int(x) for x in args.levels.split(",")]:
            if time.monotonic() > deadline:
                break
            on = tokens_per_s(servers[best].url, c, args.tokens, 2)
            off = tokens_per_s(base.url, c, args.tokens, 2)
            surface.append({"c": c, "k": best, "spec_tokens_per_s": round(on, 1), "base_tokens_per_s": round(off, 1),
                            "speedup": round(on / off, 3)})  # fmt: skip
            say(f"c={c}: {surface[-1]}")
        result["surface"] = surface
        # 5. the switch cost: stop the speculating engine, start method none, until it answers
        for k in KS:
            if k != best:
                servers.pop(k).stop()
        switches = []
        current = servers.pop(best)
        for i in range(args.switches):
            if time.monotonic() > deadline:
                break
            t0 = time.monotonic()
            current.stop()
            nxt = Server(exe, target, None if i % 2 == 0 else draft, best, work / f"server-switch{i}.log")
            nxt.wait_ready()
            complete(nxt.url, 8)
            switches.append(round(time.monotonic() - t0, 2))
            current = nxt
        servers["switch"] = current
        result["switch_s"] = {"median": statistics.median(switches) if switches else None, "each": switches}
    finally:
        for s in servers.values():
            s.stop()
    result["steps"]["measure_s"] = round(time.monotonic() - t_start - result["steps"]["build_s"], 1)
    result["measured_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    say(f"wrote {args.out}")
    return result


def table(path: Path) -> str:
    """The README's GPU table from a results file."""
    r = json.loads(path.read_text())
    m = r["models"]
    lines = [
        f"GPU: {r['machine']['gpu']}; layer-skip pair {m['hidden']}×{m['layers']} "
        f"({m['target_params'] / 1e9:.2f} B target, draft = its first layer); measured {r['measured_at']}.",
        "",
        "| k | tokens/s (c=1) | speedup | acceptance |",
        "|---|---|---|---|",
    ]
    for row in r["speedup_vs_k"]:
        acc = "" if row["acceptance"] is None else f"{row['acceptance']:.2f}"
        lines.append(f"| {row['k'] or 'none'} | {row['tokens_per_s']} | {row['speedup']:.2f} | {acc} |")
    lines += ["", "| c | k | tokens/s with | without | speedup |", "|---|---|---|---|---|"]
    for row in r["surface"]:
        lines.append(
            f"| {row['c']} | {row['k']} | {row['spec_tokens_per_s']} | {row['base_tokens_per_s']} | "
            f"{row['speedup']:.2f} |"
        )
    sw = r["switch_s"]
    lines += [
        "",
        f"Switch (stop, start the other method, first answer): median {sw['median']} s over {len(sw['each'])}.",
    ]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pack", help="trim the llama.cpp source out of the llama-cpp-python sdist")
    p.add_argument("--sdist", type=Path, required=True)
    p.add_argument("--out", type=Path, default=DEFAULT_SRC)
    r = sub.add_parser("run", help="build, generate, measure (needs the GPU)")
    r.add_argument("--src", default=str(DEFAULT_SRC), help="the trimmed source (pack)")
    r.add_argument("--work", default="gpu-check-work")
    r.add_argument("--out", default="gpu-results.json")
    r.add_argument("--hidden", type=int, default=2048)
    r.add_argument("--layers", type=int, default=16)
    r.add_argument("--tokens", type=int, default=128)
    r.add_argument("--reps", type=int, default=7)
    r.add_argument("--switches", type=int, default=4)
    r.add_argument("--budget", type=float, default=420, help="seconds for the measurements (after build, models)")
    r.add_argument("--jobs", type=int, default=os.cpu_count() or 4)
    r.add_argument("--llama-server", help="use this llama-server instead of building one")
    r.add_argument("--dry-run", action="store_true", help="no GPU: every step on the CPU (to try the script)")
    r.add_argument("--levels", default=",".join(map(str, LEVELS)), help="concurrency levels of the surface")
    t = sub.add_parser("table", help="the README table from a results file")
    t.add_argument("results", type=Path)
    a = ap.parse_args(argv)
    if a.cmd == "pack":
        print(json.dumps(pack(a.sdist, a.out)))
    elif a.cmd == "run":
        run(a)
    else:
        print(table(a.results), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
