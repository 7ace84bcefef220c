"""Benchmark/correctness check of the CUTLASS ptr-array grouped GEMM experiment (libgmm.so)
against torch._grouped_mm and a dense torch.mm of the same total shape.

Run on a Hopper GPU after ./build.sh (nvcc, CUTLASS headers): python benchmarks/grouped_gemm_cutlass/bench.py
Env: OUT (if set, the markdown tables are also written to $OUT/cutlass_gmm.md)
     GMM_ITERS (default 30), GMM_WARMUP (default 5), GMM_RASTER_N=0 to skip the AlongN raster tables.
"""
import ctypes
import os
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
LIB_PATH = HERE / "libgmm.so"

# (short label, symbol stem)
VARIANTS = [
    ("a 128x256 c1x2 coop", "m128n256_c1x2_coop"),
    ("b 128x128 c1x1 coop", "m128n128_c1x1_coop"),
    ("c 128x128 c1x2 coop", "m128n128_c1x2_coop"),
    ("d 64x256 c1x2 pp", "m64n256_c1x2_pp"),
    ("e 128x256 c2x1 coop", "m128n256_c2x1_coop"),
    ("f 128x128 c1x2 pp", "m128n128_c1x2_pp"),
    ("g 128x256 c1x1 coop", "m128n256_c1x1_coop"),
]

E, T = 8, 8192
PATTERNS = {
    "even": [1024] * 8,
    "mild": [976, 1088, 1024, 1040, 1008, 1072, 992, 992],
    "skewed": [512, 1536, 768, 1280, 896, 1152, 1024, 1024],
    # brief's [0,1168,1024,...,904] sums to 7192 and 904 % 16 != 0 -> fixed to 16-multiples summing to 8192
    "zero-group": [0, 1168, 1184, 1168, 1168, 1184, 1168, 1152],
}
# correctness only: tiny groups, two empty groups, groups not a multiple of any tile size
EDGE = [16, 0, 48, 4080, 0, 2000, 2032, 16]
for name, c in list(PATTERNS.items()) + [("edge", EDGE)]:
    assert len(c) == E and sum(c) == T and all(x % 16 == 0 for x in c), (name, c)

# layout -> list of (K, N)
SHAPES = {
    "tn": [(2048, 11264), (5632, 2048)],  # forward: x[T,K] @ W[e]^T, W [E,N,K]
    "nn": [(11264, 2048), (2048, 5632)],  # dgrad:   dy[T,K] @ W[e],  W [E,K,N]
}

ITERS = int(os.environ.get("GMM_ITERS", "30"))
WARMUP = int(os.environ.get("GMM_WARMUP", "5"))
DO_RASTER_N = os.environ.get("GMM_RASTER_N", "1") != "0"
TOL = 2e-2


def load_lib():
    lib = ctypes.CDLL(str(LIB_PATH))
    avail = []
    for label, stem in VARIANTS:
        ok = True
        for lay in ("tn", "nn"):
            name = f"gmm_{stem}_{lay}"
            try:
                fn = getattr(lib, name)
                ws = getattr(lib, name + "_workspace")
            except AttributeError:
                ok = False
                continue
            fn.restype = ctypes.c_int
            fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 4 + [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
            ws.restype = ctypes.c_size_t
            ws.argtypes = [ctypes.c_int]
        if ok:
            avail.append((label, stem))
        else:
            print(f"[warn] variant {stem} missing from libgmm.so, skipped")
    lib.gmm_set_raster_order.restype = ctypes.c_int
    lib.gmm_set_raster_order.argtypes = [ctypes.c_int]
    return lib, avail


class Runner:
    def __init__(self, lib, stem, layout):
        self.fn = getattr(lib, f"gmm_{stem}_{layout}")
        nbytes = getattr(lib, f"gmm_{stem}_{layout}_workspace")(E)
        self.ws = torch.empty(max(int(nbytes), 1), dtype=torch.uint8, device="cuda")
        self.nbytes = int(nbytes)

    def __call__(self, A, W, D, offs, N, K):
        return self.fn(A.data_ptr(), W.data_ptr(), D.data_ptr(), offs.data_ptr(), E, A.shape[0], N, K,
                       self.ws.data_ptr(), self.nbytes, torch.cuda.current_stream().cuda_stream)


def time_fn(fn):
    for _ in range(WARMUP):
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(ITERS)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(ITERS)]
    for i in range(ITERS):
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def make_inputs(layout, K, N, gen):
    x = torch.randn(T, K, device="cuda", generator=gen).to(torch.bfloat16)
    scale = K ** -0.5
    if layout == "tn":
        W = (torch.randn(E, N, K, device="cuda", generator=gen) * scale).to(torch.bfloat16)
    else:
        W = (torch.randn(E, K, N, device="cuda", generator=gen) * scale).to(torch.bfloat16)
    return x, W


def B_of(layout, W, e):
    return W[e].t() if layout == "tn" else W[e]  # [K, N]


def reference(layout, x, W, counts):
    out = torch.empty(T, W.shape[1] if layout == "tn" else W.shape[2], device="cuda", dtype=torch.float32)
    s = 0
    for e, c in enumerate(counts):
        if c:
            out[s:s + c] = x[s:s + c].float() @ B_of(layout, W, e).float()
        s += c
    return out


def rel_err(D, ref):
    d = D.float()
    if torch.isnan(d).any():
        return float("nan")
    return ((d - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def torch_gmm(layout, x, W, offs):
    if layout == "tn":
        return torch._grouped_mm(x, W.transpose(1, 2), offs=offs)
    return torch._grouped_mm(x, W, offs=offs)


def main():
    t_start = time.time()
    assert torch.cuda.is_available()
    print(f"torch {torch.__version__}, device {torch.cuda.get_device_name()}, lib {LIB_PATH}")
    lib, avail = load_lib()
    gen = torch.Generator(device="cuda")
    gen.manual_seed(0)
    md = []
    fails = []

    for layout, shapes in SHAPES.items():
        runners = {stem: Runner(lib, stem, layout) for _, stem in avail}
        for K, N in shapes:
            x, W = make_inputs(layout, K, N, gen)
            Bd = B_of(layout, W, 0)  # dense B with the same memory layout, [K, N]
            dense_ms = time_fn(lambda x=x, Bd=Bd: torch.mm(x, Bd))
            rows = {0: [], 2: []}  # raster order -> table rows
            hdr_extra = f"layout={layout} T={T} K={K} N={N} E={E}"
            for pname, counts in list(PATTERNS.items()) + [("edge", EDGE)]:
                timed = pname != "edge"
                offs = torch.tensor(counts, device="cuda", dtype=torch.int32).cumsum(0).to(torch.int32)
                ref = reference(layout, x, W, counts)
                # torch grouped
                try:
                    Dt = torch_gmm(layout, x, W, offs)
                    et = rel_err(Dt, ref)
                    tg_ms = time_fn(lambda layout=layout, x=x, W=W, offs=offs: torch_gmm(layout, x, W, offs)) if timed else None
                    if not (et < TOL):
                        fails.append(f"torch._grouped_mm {layout} K={K} N={N} {pname} err={et:.3g}")
                        print(f"FAIL torch._grouped_mm {layout} K={K} N={N} {pname}: rel err {et:.3g}")
                except Exception as ex:  # noqa: BLE001
                    print(f"[torch._grouped_mm error] {layout} {pname}: {ex}")
                    tg_ms = None
                for raster in ([1, 2] if DO_RASTER_N else [1]):
                    lib.gmm_set_raster_order(raster)
                    cells = []
                    for _label, stem in avail:
                        r = runners[stem]
                        D = torch.full((T, N), float("nan"), device="cuda", dtype=torch.bfloat16)
                        rc = r(x, W, D, offs, N, K)
                        torch.cuda.synchronize()
                        if rc != 0:
                            print(f"[rc={rc}] {stem} {layout} K={K} N={N} {pname} raster={raster}")
                            cells.append(f"rc={rc}")
                            fails.append(f"{stem} {layout} {pname} rc={rc}")
                            continue
                        err = rel_err(D, ref)
                        status = "ok" if err < TOL else "FAIL"
                        if status == "FAIL":
                            fails.append(f"{stem} {layout} K={K} N={N} {pname} raster={raster} err={err:.3g}")
                        print(f"{status} {stem:20s} {layout} K={K:5d} N={N:5d} {pname:10s} raster={raster} rel_err={err:.2e}")
                        if not timed:
                            continue
                        ms = time_fn(lambda r=r, x=x, W=W, D=D, offs=offs, N=N, K=K: r(x, W, D, offs, N, K))
                        cell = f"{ms:.3f} ({ms / dense_ms:.2f})"
                        if status == "FAIL":
                            cell += " FAIL"
                        cells.append(cell)
                    if timed:
                        tg = f"{tg_ms:.3f} ({tg_ms / dense_ms:.2f})" if tg_ms is not None else "err"
                        rows[0 if raster == 1 else 2].append(f"| {pname} | {dense_ms:.3f} | {tg} | " + " | ".join(cells) + " |")
                lib.gmm_set_raster_order(1)
            block = []
            for key, title in ((0, "raster AlongM (default)"), (2, "raster AlongN")):
                if not rows[key]:
                    continue
                block.append(f"\n### {hdr_extra} — CUTLASS {title}; ms (ratio to dense)\n")
                block.append("| counts | dense ms | torch grouped | " + " | ".join(name for name, _ in avail) + " |")
                block.append("|---" * (3 + len(avail)) + "|")
                block.extend(rows[key])
            print("\n".join(block))
            md.extend(block)
            torch.cuda.empty_cache()

    text = "\n".join(md) + "\n"
    if fails:
        text += "\nFAILURES:\n" + "\n".join(f"- {f}" for f in fails) + "\n"
    print("\n==================== SUMMARY ====================")
    print(text)
    print(f"total wall time {time.time() - t_start:.1f}s")
    out = os.environ.get("OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "cutlass_gmm.md").write_text(text)
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
