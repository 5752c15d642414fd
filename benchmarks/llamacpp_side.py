"""The llama.cpp side of benchmarks/bench_vs_llamacpp.py, through llama-cpp-python's C API
(the bench extra), importing nothing of torch or radixserve: run as a script it is that
benchmark's llama.cpp memory row, llama.cpp alone in a process of its own.

    python benchmarks/llamacpp_side.py --model FILE.gguf --ids 1,2,3 --new-tokens 128

loads the model, samples `--new-tokens` after the prompt `--ids` in a context of their length
(flash attention on) and prints {"load_s", "peak_rss_bytes"} (VmHWM), "prefill_s" and
"decode_tok_s" as one JSON line.

A signal raised in llama.cpp's native code (SIGILL from a natively built llama-cpp-python on a
VM that shows AMX flags without enabling AMX tile state) kills the process it hits, so a
script that loads llama.cpp runs its work under `supervise`: a child process does the work and
the parent names the signal, with the rebuild command for SIGILL (`check_child`).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TEMPERATURE = 0.7
FLASH = {"off": 0, "on": 1}  # LLAMA_FLASH_ATTN_TYPE_DISABLED / _ENABLED
I32 = ctypes.c_int32  # llama_token, llama_pos and llama_seq_id are all int32
SUPERVISED = "RADIXSERVE_BENCH_SUPERVISED"  # set in the child that does a supervised script's work
# llama.cpp's x86 CMake options (ggml/CMakeLists.txt) that GGML_NATIVE=OFF leaves off, each with
# the /proc/cpuinfo flags it compiles for; AVX2, FMA and F16C stay on by default.
OPT_IN_ISA = {
    "GGML_AVX_VNNI": ("avx_vnni",),
    "GGML_AVX512": ("avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw"),
    "GGML_AVX512_VBMI": ("avx512vbmi",),
    "GGML_AVX512_VNNI": ("avx512_vnni",),
    "GGML_AVX512_BF16": ("avx512_bf16",),
}
NO_AMX = ("GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16")


@dataclass
class LlamaRun:
    prefill_s: float  # prompt decode + the first sampled token of every sequence
    decode_s: float  # the remaining new_tokens - 1 steps
    outputs: list[list[int]]  # sampled tokens per sequence

    @property
    def wall_s(self) -> float:
        return self.prefill_s + self.decode_s


class Batch:
    """A llama_batch over ctypes arrays that Python owns (no llama_batch_init / _free), so
    all P prompt tokens can point at ONE shared array of the B sequence ids instead of P
    copies. `c` stays valid while this object lives; llama_decode only reads it.

    seq_rows[i]: the sequence ids of token i (the same array object may serve many tokens).
    """

    def __init__(self, ll: Any, seq_rows: Sequence[ctypes.Array], logits: Sequence[int]) -> None:
        n = len(seq_rows)
        ptr = ctypes.POINTER(I32)
        self.token, self.pos = (I32 * n)(), (I32 * n)()
        self.n_seq_id = (I32 * n)(*(len(r) for r in seq_rows))
        self.seq_id = (ptr * n)(*(ctypes.cast(r, ptr) for r in seq_rows))
        self.logits = (ctypes.c_int8 * n)(*logits)
        self.seq_rows = seq_rows  # the seq_id pointers point into these
        self.c = ll.llama_batch(
            n, self.token, None, self.pos, self.n_seq_id, self.seq_id, self.logits
        )

    def fill(self, tokens: Sequence[int], pos: Sequence[int]) -> Any:
        self.token[:] = list(tokens)
        self.pos[:] = list(pos)
        return self.c


def prompt_batch(ll: Any, prompt: list[int], n_seq: int) -> Batch:
    """Every prompt token in sequences 0..n_seq-1, logits on the last token only."""
    shared = (I32 * n_seq)(*range(n_seq))
    batch = Batch(ll, [shared] * len(prompt), [0] * (len(prompt) - 1) + [1])
    batch.fill(prompt, range(len(prompt)))
    return batch


def step_batch(ll: Any, n_seq: int) -> Batch:
    """One decode step: token i in sequence i only, logits on for every token (row i)."""
    return Batch(ll, [(I32 * 1)(i) for i in range(n_seq)], [1] * n_seq)


class LlamaCpp:
    """llama.cpp through llama-cpp-python's C API: one model; per row a fresh context sized
    for it (n_ctx = P + B * new tokens, n_seq_max = B, n_batch >= P so the prompt is one
    llama_decode; n_ubatch stays llama.cpp's default unless `ubatch` is given)."""

    def __init__(self, path: Path, threads: int, ubatch: int | None) -> None:
        import llama_cpp as ll  # optional dependency (the `bench` extra)

        # its log hook prints everything while this logger is at NOTSET
        logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)
        ll.llama_backend_init()
        self.ll, self.threads, self.ubatch = ll, threads, ubatch
        self.model = ll.llama_model_load_from_file(
            str(path).encode(), ll.llama_model_default_params()
        )
        assert self.model, f"llama.cpp could not load {path}"
        self.n_vocab = ll.llama_vocab_n_tokens(ll.llama_model_get_vocab(self.model))
        self.system_info = ll.llama_print_system_info().decode().strip()
        self.version = ll.__version__

    @contextmanager
    def context(self, n_ctx: int, n_seq: int, n_batch: int, flash: str) -> Iterator[Any]:
        ll = self.ll
        p = ll.llama_context_default_params()
        p.n_ctx, p.n_batch, p.n_seq_max = n_ctx, n_batch, n_seq
        if self.ubatch:
            p.n_ubatch = self.ubatch
        p.kv_unified = True  # one KV buffer for all sequences: the shared prompt stored once
        p.n_threads = p.n_threads_batch = self.threads
        p.flash_attn_type = FLASH[flash]
        ctx = ll.llama_init_from_model(self.model, p)
        assert ctx, f"llama.cpp context failed: n_ctx {n_ctx}, n_seq {n_seq}, flash {flash}"
        try:
            yield ctx
        finally:
            ll.llama_free(ctx)

    @contextmanager
    def sampler(self, seed: int) -> Iterator[Any]:
        ll = self.ll
        chain = ll.llama_sampler_chain_init(ll.llama_sampler_chain_default_params())
        ll.llama_sampler_chain_add(chain, ll.llama_sampler_init_temp(TEMPERATURE))
        ll.llama_sampler_chain_add(chain, ll.llama_sampler_init_dist(seed))
        try:
            yield chain
        finally:
            ll.llama_sampler_free(chain)  # frees the samplers the chain owns

    def decode(self, ctx: Any, batch: Any) -> None:
        rc = self.ll.llama_decode(ctx, batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc} (1: no KV slot, n_ctx too small)")

    def generate(
        self, ctx: Any, prompt: list[int], n_seq: int, new_tokens: int, seed: int
    ) -> LlamaRun:
        """Prefill `prompt` once for `n_seq` sequences, then sample exactly `new_tokens` per
        sequence (EOS ignored) from a cleared memory."""
        ll, p = self.ll, len(prompt)
        first, step = prompt_batch(ll, prompt, n_seq), step_batch(ll, n_seq)
        outputs: list[list[int]] = [[] for _ in range(n_seq)]
        ll.llama_memory_clear(ll.llama_get_memory(ctx), True)
        with self.sampler(seed) as smpl:
            t0 = time.perf_counter()
            self.decode(ctx, first.c)
            for out in outputs:  # all sequences sample from the prompt's one output row
                out.append(ll.llama_sampler_sample(smpl, ctx, p - 1))
            t1 = time.perf_counter()
            for pos in range(p, p + new_tokens - 1):  # positions of the tokens fed back
                self.decode(ctx, step.fill([o[-1] for o in outputs], [pos] * n_seq))
                for i, out in enumerate(outputs):
                    out.append(ll.llama_sampler_sample(smpl, ctx, i))
            t2 = time.perf_counter()
        return LlamaRun(t1 - t0, t2 - t1, outputs)

    @contextmanager
    def warm_context(
        self, prompt: list[int], n_seq: int, new_tokens: int, flash: str
    ) -> Iterator[Any]:
        """A fresh context sized for the row, after one short warm-up run (threads, compute
        buffers)."""
        n_ctx = len(prompt) + n_seq * new_tokens
        with self.context(n_ctx, n_seq, max(len(prompt), n_seq), flash) as ctx:
            self.generate(ctx, prompt[:16], n_seq, 2, seed=0)
            yield ctx


def peak_rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


# ---------------------------------------------------------------- a signal, named


def cpu_flags() -> set[str]:
    """This machine's CPU flags from /proc/cpuinfo (none where there is no such file)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return set()
    return next((set(ln.split(":", 1)[1].split()) for ln in lines if ln.startswith("flags")), set())


def rebuild_command(flags: set[str]) -> str:
    """The pip command that rebuilds llama-cpp-python for the CPU with `flags`, without
    -march=native and without AMX."""
    on = [f"-D{option}=ON" for option, need in OPT_IN_ISA.items() if flags.issuperset(need)]
    cmake = ["-DGGML_NATIVE=OFF", *on, *(f"-D{option}=OFF" for option in NO_AMX)]
    return (
        f'CMAKE_ARGS="{" ".join(cmake)}" pip install --force-reinstall --no-deps '
        "--no-cache-dir --no-binary llama-cpp-python llama-cpp-python"
    )


def check_child(returncode: int, what: str, llamacpp: bool) -> None:
    """Return when the child process `what` exited 0. Otherwise exit this process with its
    status, 128 + N where signal N killed it, after a line on stderr naming the signal; for
    SIGILL in a process that ran llama.cpp (`llamacpp`), with the command that rebuilds
    llama-cpp-python without the instructions that trap."""
    if returncode == 0:
        return
    if returncode > 0:
        sys.exit(returncode)
    try:
        name = signal.Signals(-returncode).name
    except ValueError:  # a real-time signal has no name of its own
        name = f"signal {-returncode}"
    print(f"\n{what} died by {name}.", file=sys.stderr)
    if llamacpp and returncode == -signal.SIGILL:
        print(
            "llama-cpp-python built natively (GGML_NATIVE, its default) uses every instruction\n"
            "set the CPU shows; some VMs show amx_tile / amx_int8 without enabling AMX tile\n"
            "state, and ggml's AMX kernels then trap. Rebuild it without AMX (its -DGGML_AVX*\n"
            "options are this machine's /proc/cpuinfo flags; drop any that another CPU lacks):\n"
            f"  {rebuild_command(cpu_flags())}",
            file=sys.stderr,
        )
    sys.exit(128 - returncode)


def supervise(script: str, argv: list[str]) -> None:
    """Run `script` with `argv` again in a child process that does the work (its output
    inherited, Python's traceback dumped at a fatal signal) and exit with the child's status
    through `check_child`. In that child (SUPERVISED set) return at once: the caller goes on
    to do the work."""
    if os.environ.get(SUPERVISED):
        return
    env = {**os.environ, SUPERVISED: "1", "PYTHONFAULTHANDLER": "1"}
    done = subprocess.run([sys.executable, script, *argv], env=env)
    check_child(done.returncode, f"{Path(script).name} (llama.cpp in its process)", True)
    sys.exit(0)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--ids", required=True, help="prompt token ids, comma-separated")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    prompt = [int(t) for t in args.ids.split(",")]
    start = time.perf_counter()
    llama = LlamaCpp(args.model, args.threads, None)
    load_s = time.perf_counter() - start
    with llama.warm_context(prompt, 1, args.new_tokens, "on") as ctx:
        run = llama.generate(ctx, prompt, 1, args.new_tokens, seed=0)
    decode_tok_s = (args.new_tokens - 1) / run.decode_s
    print(json.dumps({"load_s": load_s, "peak_rss_bytes": peak_rss_bytes(),
                      "prefill_s": run.prefill_s, "decode_tok_s": decode_tok_s}))  # fmt: skip


if __name__ == "__main__":
    main()
