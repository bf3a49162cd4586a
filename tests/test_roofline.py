"""The roofline (plan/roofline.py, throughput.py, `dflash-batch plan` on a named GPU): the traffic
formulas against collectives simulated step by step, each floor's term, the acceptance curve, and
the H200 job's counted work against a hand estimate written here from config.json alone."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from dflash_batch.cli import main
from dflash_batch.job import gpu_bytes, load_job
from dflash_batch.plan.hardware import HARDWARE, Hardware, hardware
from dflash_batch.plan.roofline import (Floors, card_acceptance, expected_tokens, floors, link_bytes, memory_read,
                                        tokens_per_gpu)
from dflash_batch.plan.work import Work
from dflash_batch.sizing import ROUTED, Sizer, plan_job

JOBS = Path(__file__).resolve().parent.parent / "jobs"


# -- traffic: NCCL's algorithms simulated, rank by rank ----------------------------------------------
class Links:
    """Bytes each rank sends, by link: NVLink inside a domain of `g` ranks, the NIC across."""

    def __init__(self, ranks: int, g: int):
        self.g, self.sent = g, {"nvlink": np.zeros(ranks), "nic": np.zeros(ranks)}

    def send(self, src: int, dst: int, values: np.ndarray) -> np.ndarray:
        self.sent["nvlink" if src // self.g == dst // self.g else "nic"][src] += values.nbytes
        return values.copy()


def ring_reduce_scatter(data: list[np.ndarray], group: list[int], links: Links) -> list[np.ndarray]:
    """Each rank of `group` (data: every rank's, by rank) ends with the sum over the group of its
    1/len chunk, in group order (ring: len - 1 steps)."""
    n = len(group)
    chunks = [np.array_split(data[r], n) for r in group]
    for step in range(n - 1):
        for i in range(n):
            c = (i - step - 1) % n
            chunks[(i + 1) % n][c] = chunks[(i + 1) % n][c] + links.send(group[i], group[(i + 1) % n], chunks[i][c])
    return [chunks[i][i] for i in range(n)]


def ring_all_gather(parts: list[np.ndarray], group: list[int], links: Links) -> list[np.ndarray]:
    """Each rank of `group` ends with every rank's part, in group order (ring: len - 1 steps)."""
    n = len(group)
    held = [{i: parts[i]} for i in range(n)]
    for step in range(n - 1):
        for i in range(n):
            c = (i - step) % n
            held[(i + 1) % n][c] = links.send(group[i], group[(i + 1) % n], held[i][c])
    return [np.concatenate([held[i][c] for c in range(n)]) for i in range(n)]


def simulate(kind: str, ranks: int, g: int, floats: int) -> dict[str, float]:
    """Per-rank bytes a hierarchical collective sends on each link (rank r: domain r // g), its
    result checked: reduce-scatter in the domain, then across domains on each rank's share (its
    peers at the same place in the other domains); all-gather the other way round."""
    rng = np.random.default_rng(0)
    links, domains = Links(ranks, g), ranks // g
    data = [rng.standard_normal(floats).astype(np.float32) for _ in range(ranks)]
    inside = [list(range(d * g, (d + 1) * g)) for d in range(domains)]
    across = [list(range(j, ranks, g)) for j in range(g)]
    if kind in ("all_reduce", "reduce_scatter"):
        share = {}
        for group in inside:
            share.update(zip(group, ring_reduce_scatter(data, group, links)))
        for group in across:
            share.update(zip(group, ring_reduce_scatter([share[r] for r in range(ranks)], group, links)))
        total = sum(data)
        for r in range(ranks):  # rank r holds the sum of chunk (r mod g, r div g): its own 1/ranks
            chunk = np.array_split(np.array_split(total, g)[r % g], domains)[r // g]
            np.testing.assert_allclose(share[r], chunk, rtol=1e-4, atol=1e-4)
        if kind == "all_reduce":
            for group in across:
                share.update(zip(group, ring_all_gather([share[r] for r in group], group, links)))
            for group in inside:
                share.update(zip(group, ring_all_gather([share[r] for r in group], group, links)))
            for r in range(ranks):
                np.testing.assert_allclose(share[r], sum(data), rtol=1e-4, atol=1e-4)
    else:
        mine = {r: data[r] for r in range(ranks)}
        for group in across:
            mine.update(zip(group, ring_all_gather([mine[r] for r in group], group, links)))
        for group in inside:
            mine.update(zip(group, ring_all_gather([mine[r] for r in group], group, links)))
        # every rank's part, in the order (its place in the domain, its domain)
        want = np.concatenate([data[d * g + j] for j in range(g) for d in range(domains)])
        assert all(np.array_equal(mine[r], want) for r in range(ranks))
    assert np.ptp(links.sent["nvlink"]) == 0 and np.ptp(links.sent["nic"]) == 0  # every rank alike
    return {link: float(sent[0]) for link, sent in links.sent.items()}


@pytest.mark.parametrize("kind", ["all_reduce", "reduce_scatter", "all_gather"])
@pytest.mark.parametrize("ranks, g", [(8, 8), (4, 4), (16, 8), (8, 4), (12, 4), (6, 2)])
def test_link_bytes_are_what_the_algorithms_send(kind, ranks, g):
    floats = 2 * 3 * 4 * 5 * 7 * 8  # splits evenly in every case
    sent = simulate(kind, ranks, g, floats)
    nvlink, nic = link_bytes({kind: floats * 4}, ranks, g)
    assert (nvlink, nic) == pytest.approx((sent["nvlink"], sent["nic"])), (kind, ranks, g)


def test_a_collective_without_a_formula_or_uneven_domains_is_refused():
    with pytest.raises(ValueError, match="all_to_all"):
        link_bytes({"all_to_all": 8}, 2, 8)
    with pytest.raises(ValueError, match="16 ranks do not fill NVLink domains of 6 GPUs evenly"):
        link_bytes({"all_reduce": 8}, 16, 6)


# -- floors ------------------------------------------------------------------------------------------
def test_each_floor_is_its_bytes_or_flops_over_its_peak():
    hw = Hardware("test", hbm_tbps=2.0, tflops={"bf16": 4.0}, nvlink_gbps=100.0, nvlink_gpus=2, nic_gbps=10.0)
    work = Work({"target other": 3e12, "drafter other": 1e12}, {"all_reduce": 4e9})
    at = floors(6e12, work, hw, "bfloat16", ranks=4, per_domain=2)
    assert at.memory == pytest.approx(3.0)    # 6 TB at 2 TB/s
    assert at.compute == pytest.approx(1.0)   # 4 TFLOP at 4 TFLOP/s
    assert at.nvlink == pytest.approx(0.04)   # all-reduce in domains of 2: 2 (1/2) 4 GB = 4 GB at 100 GB/s
    assert at.nic == pytest.approx(0.2)       # across 2 domains: 2 (1/2) 4 GB / 2 = 2 GB at 10 GB/s
    assert at.network == pytest.approx(0.2)   # the links carry their shares at once
    assert (at.seconds, at.binding) == (3.0, "memory")
    assert tokens_per_gpu(10, 2.5, at, 4) == pytest.approx(10 * 2.5 / 3.0 / 4)
    assert Floors(1, 2, 1.5, 0.75).binding == "compute" and Floors(1, 2, 0.5, 2.5).binding == "network"


def test_memory_read_counts_the_experts_the_round_touches():
    assert memory_read(8, dense=100, routed=0, caches=50) == 150
    assert memory_read(1, dense=0, routed=896, caches=0, experts=896, per_token=16) == 16
    assert memory_read(10_000, dense=0, routed=896, caches=0, experts=896, per_token=16) == 896


def test_the_acceptance_curve_yields_the_acceptance_length():
    alpha = card_acceptance(4.6, 7)
    assert expected_tokens(alpha, 7) == pytest.approx(4.6)
    assert all(a > b for a, b in zip(alpha, alpha[1:])) and alpha[1] == pytest.approx(alpha[0] ** 2)
    assert expected_tokens(alpha, 0) == 1.0 and expected_tokens(alpha, 2) == pytest.approx(1 + alpha[0] + alpha[1])
    assert card_acceptance(8.0, 7) == pytest.approx([1.0] * 7, abs=1e-9)
    with pytest.raises(ValueError, match="give 1 to 8"):
        card_acceptance(9.0, 7)


def test_the_table_has_figures_for_every_gpu_a_job_names():
    from dflash_batch.job import GPUS

    assert set(HARDWARE) == set(GPUS)
    assert hardware(" H200 ").peak("bfloat16") == 989e12
    with pytest.raises(ValueError, match="no figure for float32 matmuls on h100"):
        hardware("h100").peak("float32")
    with pytest.raises(ValueError, match="name one of h100, h200, b200, gb300"):
        hardware("a100")


# -- the H200 job against a hand estimate ------------------------------------------------------------
def hand_estimate(seqs: int, k: int, context: int, tp: int, sampled: bool) -> tuple[float, dict[str, float]]:
    """(FLOPs, collective payload bytes) a rank does in a round: Kimi-K3 verifying k drafts a sequence
    and the DFlash2 drafter's block, the MLA latents split tp ways, from config.json alone: 2 FLOPs
    a weight a row (a rank's share of each weight, replicated ones whole: the MLA and KDA low-rank
    inputs, the router, the MoE's latent projections), attention every head over 1/tp of the keys;
    payloads by kind: bf16 all-reduces of each row-parallel output and the routed latent; the
    split's query and log-sum-exp gathers and float32 output reduce-scatter; the sampler's float32
    logits."""
    t = json.loads((JOBS / "models/moonshotai/Kimi-K3/config.json").read_text())["text_config"]
    d = json.loads((JOBS / "models/lightseekorg/kimi-k3-dflash2/config.json").read_text())
    H, V, layers = t["hidden_size"], t["vocab_size"], t["num_hidden_layers"]
    lin = t["linear_attn_config"]
    kda, mla, moe = len(lin["kda_layers"]), len(lin["full_attn_layers"]), layers - t["first_k_dense_replace"]
    heads, kh, kd = t["num_attention_heads"], lin["num_heads"], lin["head_dim"]
    ql, kl, dn, dr, dv = (t[x] for x in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                                         "v_head_dim"))
    E, top, lat, inter = t["num_experts"], t["num_experts_per_token"], t["routed_expert_hidden_size"], \
        t["moe_intermediate_size"]
    rows, block = seqs * (k + 1), d["dflash_config"]["block_size"]
    kda_w = 4 * H * kh * kd / tp + H * kd + kd * kh * kd / tp + H * kh / tp + kh * kd * H / tp
    mla_w = H * ql + ql * heads * (dn + dr) / tp + H * (kl + dr) + heads / tp * (dn * kl + kl * dv) + 2 * H * heads * dv / tp
    moe_w = E * H + 2 * H * lat + top * 3 * lat * inter / tp + 3 * H * t["num_shared_experts"] * inter / tp
    target = kda * kda_w + mla * mla_w + moe * moe_w + (layers - moe) * 3 * H * t["intermediate_size"] / tp + H * V / tp
    flops = 2 * rows * (target + mla * heads * (2 * kl + dr) * (context + block) / tp)
    dh, di, dl = d["num_attention_heads"], d["intermediate_size"], d["num_hidden_layers"]
    draft_w = H * ql + ql * dh * (dn + dr) / tp + H * (kl + dr) + dh / tp * (dn * kl + kl * dv) + dh * dv * H / tp \
        + 3 * H * di / tp
    keys = sum(min(d["sliding_window"], context) if kind == "sliding_attention" else context
               for kind in d["layer_types"])
    if k:
        flops += 2 * seqs * block * (dl * draft_w + dh * (2 * kl + dr) * (keys + dl * block) / tp)
        flops += 2 * seqs * (block - 1) * H * V / tp  # the proposals' logits
    flops += 2 * rows * (len(d["dflash_config"]["target_layer_ids"]) * H * H + dl * H * (kl + dr))  # context write
    bf16, drafted = 2, seqs * block if k else 0
    reduced = rows * bf16 * (H * (kda + mla) + moe * (H + lat) + (layers - moe) * H + H) + drafted * bf16 * (2 * dl + 1) * H
    # the split gathers each rank's query heads (bf16) and every head's log-sum-exp (float32)
    gathered = (rows * mla * heads / tp + drafted * dl * dh / tp) * (kl + dr) * bf16 \
        + (rows * mla * heads + drafted * dl * dh) * 4 + (rows * V / tp * 4 if sampled else 0)
    scattered = (rows * mla * heads + drafted * dl * dh) * kl * 4
    return flops, {"all_reduce": reduced, "all_gather": gathered, "reduce_scatter": scattered}


@pytest.fixture(scope="module")
def h200():
    job = load_job(JOBS / "kimi-k3-dflash2-h200.yaml")
    return job, plan_job(job, JOBS, gpu_bytes("h200"), with_split=True)


@pytest.mark.parametrize("k", [7, 2, 0])
def test_the_h200_jobs_round_is_what_a_hand_estimate_says(h200, k):
    job, plan = h200
    need = plan.runs.needs[0]
    seqs = need.bucket.max_num_seqs  # 171: a capture size, no padding rows
    work = plan.runs.sizer.work(need.bucket, k + 1).times(seqs)
    flops, payloads = hand_estimate(seqs, k, need.bucket.max_tokens, plan.tp, sampled=True)
    assert work.total_flops == pytest.approx(flops, rel=0.03)
    for kind, payload in payloads.items():
        assert work.collectives.get(kind, 0) == pytest.approx(payload, rel=0.03), kind
    at = floors(plan.runs.sizer.read(need.bucket, seqs, seqs * (k + 1)), work, HARDWARE["h200"], "bfloat16", 16, 8)
    # Two nodes of 8: inside each, ring all-reduces move 2 (7/8) of their payload, reduce-scatters
    # 7/8, all-gathers 7 x 2 payloads; each NIC carries its 1/8 share across (an all-reduce's half
    # of it out and back), an all-gather one payload.
    ar, ag, rs = payloads["all_reduce"], payloads["all_gather"], payloads["reduce_scatter"]
    assert at.nvlink == pytest.approx((2 * 7 / 8 * ar + 7 / 8 * rs + 14 * ag) / 450e9, rel=0.03)
    assert at.nic == pytest.approx((ar / 8 + rs / 16 + ag) / 50e9, rel=0.03)
    assert at.compute == pytest.approx(flops / 989e12, rel=0.03)


def test_the_plan_prints_each_buckets_floors_and_best_draft_count():
    out = CliRunner().invoke(main, ["plan", str(JOBS / "kimi-k3-dflash2-h200.yaml")])
    assert out.exit_code == 0, out.output
    text = out.output
    assert "roofline on h200, TP16 (8 GPUs an NVLink domain), with the MLA latents split 16 ways" in text
    assert "a bound, not a prediction: the floors may overlap" in text
    for bucket, seqs in (("0-8192", 171), ("8192-32768", 93)):
        section = text.split(f"bucket {bucket}, {seqs} seqs (the job's)")[1]
        rows = section.splitlines()[2:10]
        assert [int(r.split()[0]) for r in rows] == list(range(8))
        assert all(r.split()[6] in ("memory", "compute", "network") for r in rows)
        best = max(rows, key=lambda r: float(r.split()[7].replace(",", "")))
        assert f"best k = {best.split()[0]}: {best.split()[7]} tokens/s per GPU" in section
        layouts = section.split("bucket")[0]
        staged = {name: row.split() for name in ("one micro-batch (they take turns)", "2 micro-batches (captured: fill, drain)",
                                                   "2 lanes (interleaved, eager)")
                  for row in layouts.splitlines() if f"2 stages x TP8, {name}" in row}
        assert len(staged) == 3, layouts
        # a captured round's two micro-batches take 3 turns of the busiest stage, two lanes' rounds 2
        ms = {name: [float(v) for v in row[-6:-2]] for name, row in staged.items()}
        groups, lanes = ms["2 micro-batches (captured: fill, drain)"], ms["2 lanes (interleaved, eager)"]
        assert [g / 3 for g in groups] == pytest.approx([v / 2 for v in lanes], abs=0.1)


# -- a finished run's acceptance, and what the plan refuses ------------------------------------------
def fake_run(tmp_path: Path, model_dir: Path, name: str, block: int) -> Path:
    """A run's output directory whose rows' rounds verified up to block - 1 drafts (tests/fake_engine.py)."""
    from dflash_batch.plan.shards import Shard
    from dflash_batch.runner import run_job
    from tests.fake_engine import fake_factory
    from tests.jobs_util import base_job, write_job, write_jsonl

    write_jsonl(tmp_path / "p.jsonl", [{"id": f"r{i}", "prompt": "fox " * (1 + i)} for i in range(12)])
    doc = base_job(model_dir, ["p.jsonl"], output={"dir": name})
    run_job(write_job(tmp_path, doc, f"{name}.yaml"), fake_factory(block_size=block), Shard(0, 1), progress=False)
    return tmp_path / name


@pytest.fixture(scope="module")
def tiny_job(tmp_path_factory) -> Path:
    """The tiny Kimi-K3 pair in bfloat16 on an H200, one bucket."""
    import yaml

    from dflash_batch.testing import kimi_pair

    d = tmp_path_factory.mktemp("tiny_job")
    target, drafter = kimi_pair.make_kimi_pair(d / "pair")
    doc = {"input": {"paths": ["p.jsonl"], "prompt_column": "prompt"}, "output": {"dir": "out"},
           "model": {"target": str(target), "drafter": str(drafter), "dtype": "bfloat16"},
           "engine": {"max_model_len": 256, "gpu_memory": "h200"}, "buckets": [{"max_tokens": 256, "max_num_seqs": 4}]}
    (d / "job.yaml").write_text(yaml.safe_dump(doc))
    return d / "job.yaml"


def test_the_roofline_takes_a_finished_runs_acceptance(tiny_job, tmp_path, model_dir):
    from dflash_batch.report import build_report

    out = fake_run(tmp_path, model_dir, "whole", 8)
    alpha = build_report(out)["overall"]["alpha"]
    result = CliRunner().invoke(main, ["plan", str(tiny_job), "--acceptance", str(out)])
    assert result.exit_code == 0, result.output
    assert f"alpha = {', '.join(f'{a:.2f}' for a in alpha)})" in result.output
    row = next(line for line in result.output.splitlines() if line.split()[:1] == ["7"])
    assert float(row.split()[1]) == pytest.approx(1 + sum(alpha), abs=0.005)  # tokens verifying all 7


@pytest.mark.parametrize("args, error", [
    (["--acceptance", "{short}"], "--acceptance {short}: no acceptance recorded for draft(s) 4-7 of 7 (its rounds "
                                  "never verified them, or its parts predate per-draft stats)"),
    (["--acceptance", "{empty}"], "--acceptance: {empty}: no committed part files yet"),
    (["--gpu-memory", "h300"], "--gpu-memory: GPU memory 'h300': give a size in GB (1 or more) or one of h100"),
    (["--acc-len", "0.5"], "--acc-len 0.5: give a number of 1 or more"),
    (["--gpu-memory", "141", "--acceptance", "{short}"], "--acceptance is for the roofline: name the GPU (h100, "),
])
def test_bad_roofline_input_is_one_line_and_exit_2(tiny_job, tmp_path, model_dir, args, error):
    short = fake_run(tmp_path, model_dir, "short", 4)  # rounds of at most 3 drafts
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "run.json").write_text(json.dumps({"num_shards": 1, "job": {"input": {"paths": ["x"]}}}))
    args = [a.format(short=short, empty=empty) for a in args]
    result = CliRunner().invoke(main, ["plan", str(tiny_job), *args])
    assert result.exit_code == 2, result.output
    assert len(result.output.splitlines()) == 1, result.output
    assert result.output.startswith(f"error: {error.format(short=short, empty=empty)}"), result.output


def test_a_group_that_does_not_fill_its_nvlink_domains_is_refused_in_one_line():
    result = CliRunner().invoke(main, ["plan", str(JOBS / "kimi-k3-dflash2-h200.yaml"), "--gpus-per-node", "6"])
    assert result.exit_code == 2 and len(result.output.splitlines()) == 1, result.output
    assert result.output == "error: TP16 does not fill NVLink domains of 6 GPUs evenly (--gpus-per-node)\n"


def test_a_job_whose_dtype_has_no_figure_is_refused_in_one_line(tiny_job, tmp_path):
    import yaml

    doc = yaml.safe_load(tiny_job.read_text())
    doc["model"]["dtype"] = "float32"
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(doc))
    result = CliRunner().invoke(main, ["plan", str(tmp_path / "job.yaml")])
    assert result.exit_code == 2 and len(result.output.splitlines()) == 1, result.output
    assert result.output.startswith("error: roofline: no figure for float32 matmuls on h200 (its table has bf16, fp16, "
                                    "fp8); --no-roofline plans memory alone"), result.output
    assert CliRunner().invoke(main, ["plan", str(tmp_path / "job.yaml"), "--no-roofline"]).exit_code == 0


def test_a_job_without_a_drafter_gets_its_target_only_round(tiny_job, tmp_path):
    import yaml

    doc = yaml.safe_load(tiny_job.read_text())
    del doc["model"]["drafter"]
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(doc))
    result = CliRunner().invoke(main, ["plan", str(tmp_path / "job.yaml")])
    assert result.exit_code == 0, result.output
    section = result.output.split("bucket 0-256, 4 seqs (the job's)")[1].splitlines()
    assert section[2].split()[:2] == ["0", "1.00"] and section[3].startswith("    best k = 0:"), result.output
    assert "alpha = )" in result.output


def test_a_job_of_pipeline_stages_is_planned_stage_by_stage(tiny_job, tmp_path):
    """Its memory plan sizes each stage (a line a stage, the fullest in the table); its roofline
    points to the tensor-parallel plan of the same GPUs, whose layouts lines hold the stages."""
    import yaml

    doc = yaml.safe_load(tiny_job.read_text())
    doc["model"]["pipeline_parallel_size"] = 2
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(doc))
    result = CliRunner().invoke(main, ["plan", str(tmp_path / "job.yaml")])
    assert result.exit_code == 0, result.output
    assert "stage 0 of 2: target layers 0-" in result.output and "stage 1 of 2: target layers " in result.output
    assert ", stage 1 of 2 (the fullest)" in result.output or ", stage 0 of 2 (the fullest)" in result.output
    assert "in the plan of this job with tensor_parallel_size 2 and pipeline_parallel_size 1" in result.output


# -- experts across data-parallel groups ---------------------------------------------------------------
def test_dispatch_and_combine_cross_the_nic_once_a_remote_group():
    """A GPU sends its share of the rows to each of the other groups' peers (groups - 1 payloads) and
    takes back the reduce-scatter of the sums ((groups - 1) / groups of the gathered partials)."""
    assert link_bytes({"dispatch": 100, "combine": 300}, 8, 8, groups=3) == pytest.approx((0, 200 + 200))
    assert link_bytes({"dispatch": 100, "combine": 300}, 8, 8) == (0, 0)  # one group: nothing crosses


def test_the_h200_plan_sets_the_three_layouts_side_by_side_and_experts_serve_every_group(h200):
    """The H200 job's plan prints TP16, 2 stages x TP8 and 2 data-parallel groups x TP8 with the routed
    experts over all 16 GPUs, each with its seqs and floors (the EP row with a GPU's weights, caches and
    buffers); an EP rank's routed FLOPs for s sequences a group are TP16's for the 2s sequences of both
    groups, and its dispatch carries 1/8 of its group's latent rows to the other group a MoE layer."""
    job, plan = h200
    text = CliRunner().invoke(main, ["plan", str(JOBS / "kimi-k3-dflash2-h200.yaml")]).output
    for bucket, seqs in (("0-8192", 171), ("8192-32768", 93)):
        layouts = text.split(f"bucket {bucket}, {seqs} seqs (the job's)")[1].split("layouts at")[1].split("bucket")[0]
        names = [line.split("(")[0].strip() for line in layouts.splitlines()[1:] if line.strip()]
        assert names[0] == "TP16, with the MLA latents split 16 ways" and "2 stages x TP8, one micro-batch" in names
        ep = next(line for line in layouts.splitlines() if "DP2 x TP8 + EP16 (" in line)
        assert re.search(r"\(\d+\+\d+\+\d+ GB\)\s+\d+\s+3\.59", ep), ep
    assert "the hottest rank's routed tokens 1.11x the mean (assumed" in text
    ep = Sizer(job, JOBS, 8, plan.runs.sizer.setup, latent_split=True, groups=2, expert_parallel=True)
    bucket, seqs, width = plan.runs.needs[0].bucket, 10, 5
    routed_ep = ep.work(bucket, width).times(seqs).flops["target routed experts"]
    routed_tp = plan.runs.sizer.work(bucket, width).times(2 * seqs).flops["target routed experts"]
    assert routed_ep == pytest.approx(routed_tp, rel=0.01)
    t = json.loads((JOBS / "models/moonshotai/Kimi-K3/config.json").read_text())["text_config"]
    moe = t["num_hidden_layers"] - t["first_k_dense_replace"]
    dispatched = ep.work(bucket, width).collectives["dispatch"]  # a sequence's rows: latent, ids, weights
    assert dispatched == pytest.approx(moe * width / 8 * (t["routed_expert_hidden_size"] * 2
                                                          + t["num_experts_per_token"] * (8 + 2)), rel=0.01)
    # A round of 2 rows on an EP rank touches the experts both groups' 4 rows route to.
    weights, one = ep.weights(), dataclasses.replace(bucket, max_num_seqs=1)
    routed = weights[ROUTED]
    assert ep.read(bucket, 1, 2) == memory_read(4, sum(weights.values()) - routed, routed, ep.need(one).caches,
                                                t["num_experts"], t["num_experts_per_token"])


def test_the_expert_parallel_layout_takes_a_runs_measured_imbalance(tiny_job, tmp_path):
    """--routing RUN_DIR: the hottest expert rank over the mean from a run's routing counts, placed
    over the layout's ranks as `experts place` would, averaged over layers; the DP x TP + EP row is
    the job's own (DP2 x TP1 + EP2, a GPU an NVLink domain)."""
    from dflash_batch.models.layers.expert_parallel import imbalance, place

    counts = {"1": [90, 5, 5, 40, 30, 10, 10, 10], "2": [1, 1, 1, 1, 1, 1, 1, 9]}
    (tmp_path / "run" / "stats").mkdir(parents=True)
    (tmp_path / "run" / "stats" / "shard-00000.json").write_text(json.dumps({"experts": {"routed_tokens": counts}}))
    import yaml

    doc = yaml.safe_load(tiny_job.read_text())
    doc["model"].update(data_parallel_size=2, expert_parallel=True)
    (tmp_path / "ep.yaml").write_text(yaml.safe_dump(doc))
    out = CliRunner().invoke(main, ["plan", str(tmp_path / "ep.yaml"), "--gpus-per-node", "1",
                                    "--routing", str(tmp_path / "run")])
    assert out.exit_code == 0, out.output
    want = sum(imbalance(c, place(c, 2)) for c in counts.values()) / 2
    assert f"routed tokens {want:.2f}x the mean (from {tmp_path / 'run'})" in out.output
    assert "DP2 x TP1 + EP2, without the MLA latents split (as run; " in out.output
    refused = CliRunner().invoke(main, ["plan", str(tiny_job), "--no-roofline", "--routing", str(tmp_path / "run")])
    assert refused.exit_code == 2 and "--routing is for the roofline" in refused.output
