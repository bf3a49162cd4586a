"""What the GPUs engine.gpu_memory names can do, a GPU at a time: the figures the plan's roofline
divides by (plan/roofline.py). Peaks, from NVIDIA's datasheets; a round runs below them.

| GPU | HBM TB/s | dense TFLOPS BF16 / FP8 / FP4 | NVLink GB/s a direction | GPUs an NVLink domain | NIC GB/s |
|---|---|---|---|---|---|
| H100 SXM5 | 3.35 | 989 / 1,979 / - | 450 (NVLink 4: 900 both ways) | 8 (HGX) | 50 (ConnectX-7, 400 Gb/s) |
| H200 SXM | 4.8 | 989 / 1,979 / - | 450 | 8 (HGX) | 50 |
| B200 (HGX) | 8 | 2,250 / 4,500 / 9,000 | 900 (NVLink 5: 1.8 TB/s both ways) | 8 (HGX) | 50 |
| GB300 (NVL72) | 8 | 2,500 / 5,000 / 15,000 | 900 | 72 (the rack) | 100 (ConnectX-8, 800 Gb/s) |

Sources: H100 and H200 datasheets (nvidia.com/en-us/data-center/h100, /h200: "FP8 3,958 TFLOPS"
and "BF16 1,979 TFLOPS" are with sparsity, dense is half); HGX B200 datasheet (for 8 GPUs, with
sparsity: FP4 144, FP8 72, FP16/BF16 36 PFLOPS; dense is half); GB300 NVL72 figures as gathered in
the project's reference notes from NVIDIA's and resellers' pages (../shared/reference/scaling_out.md,
section 5: dense FP4 15, FP8 5, BF16 2.5 PFLOPS a GPU; 8 TB/s); NVLink 4 and 5 and ConnectX-7/8
product pages. The NIC is one a GPU, as HGX and NVL72 systems are built. The FP8 and FP4 peaks are
for reference: every matmul the engine runs is in the model's dtype (COMPUTE_DTYPE).
"""

from __future__ import annotations

from dataclasses import dataclass

# The compute dtype a matmul runs in, by the model's dtype. The routed experts' MXFP4 weights are
# dequantised to it in the kernel (kernels/moe_mxfp4.py: W4A16 on every GPU), so it is every
# matmul's.
COMPUTE_DTYPE = {"bfloat16": "bf16", "float16": "fp16"}


@dataclass(frozen=True)
class Hardware:
    name: str
    hbm_tbps: float             # peak HBM bandwidth, TB/s
    tflops: dict[str, float]    # dense peak by compute dtype
    nvlink_gbps: float          # a GPU's NVLink bandwidth, one direction, GB/s
    nvlink_gpus: int            # GPUs one NVLink domain joins
    nic_gbps: float             # a GPU's network bandwidth across domains, one direction, GB/s

    def peak(self, dtype: str) -> float:
        """Dense FLOP/s for a model of `dtype` (job.model.dtype); a ValueError names what is missing."""
        compute = COMPUTE_DTYPE.get(dtype)
        if compute is None or compute not in self.tflops:
            have = ", ".join(sorted(self.tflops))
            raise ValueError(f"no figure for {dtype} matmuls on {self.name} (its table has {have})")
        return self.tflops[compute] * 1e12


HARDWARE = {
    "h100": Hardware("h100", 3.35, {"bf16": 989, "fp16": 989, "fp8": 1979}, 450, 8, 50),
    "h200": Hardware("h200", 4.8, {"bf16": 989, "fp16": 989, "fp8": 1979}, 450, 8, 50),
    "b200": Hardware("b200", 8.0, {"bf16": 2250, "fp16": 2250, "fp8": 4500, "fp4": 9000}, 900, 8, 50),
    "gb300": Hardware("gb300", 8.0, {"bf16": 2500, "fp16": 2500, "fp8": 5000, "fp4": 15000}, 900, 72, 100),
}


def hardware(name: str) -> Hardware:
    """The figures of a named GPU; a ValueError names the known ones."""
    key = str(name).strip().lower()
    if key not in HARDWARE:
        raise ValueError(f"no roofline figures for a GPU named {name!r}: name one of {', '.join(HARDWARE)}")
    return HARDWARE[key]
