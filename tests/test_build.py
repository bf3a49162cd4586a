"""What a job's engine settings become on a host (dflash_batch.build.resolve_engine): the backend,
device, kernels, CUDA graphs and compilation a host and model pair allow, and every setting that
could not take effect refused with its reason before any work. Hosts with CUDA, flashinfer and
Triton are simulated: resolve_engine only looks at what they have."""

from __future__ import annotations

import json

import pytest

from dflash_batch.build import resolve_engine
from dflash_batch.job import JobError, parse_job
from dflash_batch.models.layers.expert_parallel import Placement, place

CPU, GPU = dict(cuda=False, flashinfer=False, triton=False), dict(cuda=True, flashinfer=True, triton=True)
GPU_NO_FLASHINFER, GPU_NO_TRITON = dict(GPU, flashinfer=False), dict(GPU, triton=False)


@pytest.fixture()
def checkpoints(tmp_path):
    """config.json of a Qwen3 target, Kimi-K3 targets (experts unpacked and MXFP4; tiny and
    production MLA latents), GQA drafters (one with 32-wide heads,
    one whose sliding window is shorter than its block) and MLA drafters (tiny, production
    width, causal)."""
    gqa = {"architectures": ["DFlashDraftModel"], "head_dim": 128, "dflash_config": {"block_size": 8}}
    mla = {"architectures": ["DFlash2DraftModel"], "dflash_config": {"attention_mode": "mla", "block_size": 8}}
    configs = {"qwen3": {"architectures": ["Qwen3ForCausalLM"], "head_dim": 128},
               "kimi": {"architectures": ["KimiK3ForConditionalGeneration"], "text_config": {}},
               "kimi_mxfp4": {"architectures": ["KimiK3ForConditionalGeneration"], "text_config": {},
                              "quantization_config": {"quant_method": "compressed-tensors"}},
               "gqa": gqa, "gqa32": {**gqa, "head_dim": 32},
               "short_window": {**gqa, "sliding_window": 6, "layer_types": ["sliding_attention", "full_attention"]},
               "mla": mla,
               "kimi_real": {"architectures": ["KimiK3ForConditionalGeneration"],
                             "quantization_config": {"quant_method": "compressed-tensors"},
                             "text_config": {"kv_lora_rank": 512, "qk_rope_head_dim": 64}},
               "mla_real": {**mla, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "sliding_window": 4096,
                            "layer_types": ["sliding_attention", "full_attention"]},
               "mla_causal": {**mla, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "sliding_window": 4096,
                              "layer_types": ["sliding_attention", "full_attention"], "is_causal": True}}
    for name, config in configs.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config))
    return tmp_path


def job(checkpoints, target="qwen3", drafter="gqa", tp=1, dtype="bfloat16", pp=1, **engine):
    model = dict(target=str(checkpoints / target), tensor_parallel_size=tp, dtype=dtype, pipeline_parallel_size=pp)
    if drafter:
        model["drafter"] = str(checkpoints / drafter)
    return parse_job(dict(input=dict(paths=["p.jsonl"], prompt_column="p"), model=model,
                          engine=dict(max_num_seqs=12, **engine), output=dict(dir="out"),
                          buckets=[dict(max_tokens=1024), dict(max_tokens=4096, max_num_seqs=3)]))


def test_defaults_on_a_cpu_host(checkpoints):
    setup = resolve_engine(job(checkpoints), **CPU)
    assert (setup.device, setup.backend, setup.cuda_graphs, setup.compile) == ("cpu", "torch", False, True)
    assert setup.kernels == resolve_engine(job(checkpoints), **dict(CPU, triton=True)).kernels == "torch"
    for target in ("kimi", "kimi_mxfp4"):  # the torch MoE groups rows by expert on the host
        kimi = resolve_engine(job(checkpoints, target, "mla"), **CPU)
        assert (kimi.backend, kimi.compile) == ("torch", False)
    assert resolve_engine(job(checkpoints, tp=2), **CPU).compile is False


def test_defaults_on_a_gpu_host(checkpoints):
    setup = resolve_engine(job(checkpoints), **GPU)
    assert (setup.device, setup.backend, setup.cuda_graphs, setup.compile) == ("cuda", "flashinfer", True, False)
    assert setup.kernels == "triton" and "kernels=triton" in setup.describe()
    assert setup.capture_sizes == [1, 2, 4, 8, 12]  # powers of two up to the largest max_num_seqs, and it
    assert resolve_engine(job(checkpoints), **GPU_NO_FLASHINFER).backend == "torch"
    kimi = resolve_engine(job(checkpoints, "kimi", "mla"), **GPU)
    assert (kimi.device, kimi.backend, kimi.cuda_graphs) == ("cuda", "torch", False)
    # MXFP4 experts through the Triton MoE: the round reads nothing on the host, so it is captured
    kimi = resolve_engine(job(checkpoints, "kimi_mxfp4", "mla"), **GPU)
    assert (kimi.device, kimi.backend, kimi.cuda_graphs, kimi.capture_sizes) == ("cuda", "torch", True, [1, 2, 4, 8, 12])
    # ... which a GPU host without Triton does not have: its torch MoE groups them on the host
    kimi = resolve_engine(job(checkpoints, "kimi_mxfp4", "mla"), **GPU_NO_TRITON)
    assert (kimi.kernels, kimi.cuda_graphs) == ("torch", False)
    assert resolve_engine(job(checkpoints), **GPU_NO_TRITON).cuda_graphs  # a Qwen3 round reads nothing either way
    # backend: torch is the CPU reference path, even here
    assert resolve_engine(job(checkpoints, backend="torch"), **GPU).device == "cpu"


@pytest.mark.parametrize("host, target, drafter, engine, tp, reason", [
    (CPU, "qwen3", "gqa", dict(backend="flashinfer"), 1, "needs a CUDA device"),
    (GPU_NO_FLASHINFER, "qwen3", "gqa", dict(backend="flashinfer"), 1, "flashinfer is not installed"),
    (GPU, "kimi", None, dict(backend="flashinfer"), 1, r"512 \+ 64 latent .* not \[\(None, None\)\]"),
    (GPU, "qwen3", "mla", dict(backend="flashinfer"), 1, "512 \\+ 64 latent"),
    (GPU, "kimi_real", "mla_causal", dict(backend="flashinfer"), 1, "non-causal"),
    (GPU, "qwen3", "gqa32", dict(backend="flashinfer"), 1, r"head_dim 64, 128 or 256, not \[32\]"),
    (GPU, "qwen3", "short_window", dict(backend="flashinfer"), 1, r"sliding window \(6\) is shorter than its block"),
    (CPU, "qwen3", "gqa", dict(cuda_graphs=True), 1, "cuda_graphs: true cannot take effect: they need a CUDA"),
    (GPU, "kimi", "mla", dict(cuda_graphs=True), 1, "stored unpacked .* grouped by expert on the host"),
    (GPU, "qwen3", "gqa", dict(compile=True), 1, "compile: true cannot take effect: compilation is the CPU path"),
    (CPU, "kimi_mxfp4", None, dict(compile=True), 1, "grouped by expert on the host by the torch path"),
    (CPU, "qwen3", "gqa", dict(compile=True), 2, "tensor_parallel_size > 1 is not compiled"),
    (CPU, "qwen3", "gqa", dict(cudagraph_capture_sizes=[1, 2]), 1, "capture_sizes is set but CUDA graphs are off"),
    (GPU, "qwen3", "gqa", dict(cudagraph_capture_sizes=[1, 2, 4]), 1, "must reach every bucket's max_num_seqs"),
    (CPU, "qwen3", "gqa", dict(context_parallel=True), 2, "Qwen3ForCausalLM keeps GQA caches"),
    (CPU, "kimi", "gqa", dict(context_parallel=True), 2, "model.drafter keeps GQA caches"),
    (CPU, "kimi", "mla", dict(context_parallel=True), 1, "tensor_parallel_size is 1"),
    (CPU, "kimi", "mla", dict(context_parallel=True, page_size=12), 8, "page_size 12 is not a multiple of"),
], ids=["flashinfer_cpu", "flashinfer_missing", "flashinfer_kimi", "flashinfer_mla", "flashinfer_causal_mla",
        "flashinfer_head32", "flashinfer_short_window", "graphs_cpu", "graphs_kimi", "compile_gpu", "compile_kimi",
        "compile_tp", "sizes_without_graphs", "sizes_short", "split_qwen3", "split_gqa_drafter", "split_tp1",
        "split_page"])
def test_settings_that_cannot_take_effect_are_refused(checkpoints, host, target, drafter, engine, tp, reason):
    with pytest.raises(JobError, match=reason):
        resolve_engine(job(checkpoints, target, drafter, tp, **engine), **host)


def test_tensor_parallel_ranks_capture_graphs(checkpoints):
    for target, drafter in (("qwen3", "gqa"), ("kimi_real", "mla_real")):
        setup = resolve_engine(job(checkpoints, target, drafter, tp=8), **GPU)
        assert setup.cuda_graphs and setup.capture_sizes == [1, 2, 4, 8, 12]


def test_flashinfer_runs_kimi_k3_and_its_mla_drafter(checkpoints):
    setup = resolve_engine(job(checkpoints, "kimi_real", "mla_real"), **GPU)
    assert (setup.device, setup.backend, setup.cuda_graphs) == ("cuda", "flashinfer", True)


def test_flashinfer_wants_half_precision(checkpoints):
    with pytest.raises(JobError, match="half precision"):
        resolve_engine(job(checkpoints, dtype="float32", backend="flashinfer"), **GPU)
    assert resolve_engine(job(checkpoints, dtype="float32"), **GPU).backend == "torch"  # auto


def test_explicit_off_switches(checkpoints):
    setup = resolve_engine(job(checkpoints, cuda_graphs=False, compile=False), **GPU)
    assert (setup.cuda_graphs, setup.compile, setup.capture_sizes) == (False, False, None)
    assert resolve_engine(job(checkpoints, compile=False), **CPU).compile is False


def test_missing_checkpoint_is_named(checkpoints):
    with pytest.raises(JobError, match=r"model\.target .*nowhere.*no config\.json"):
        resolve_engine(job(checkpoints, target="nowhere"), **CPU)


@pytest.mark.parametrize("drafts, refused", [(7, False), (8, True)])
def test_pinned_drafts_past_the_drafters_block_are_refused_before_loading(checkpoints, drafts, refused):
    """The drafter's block (8, from its config.json) holds 7 drafts: {drafts: 8} cannot run."""
    doc = job(checkpoints).model_dump(mode="json", exclude_none=True)
    doc["buckets"] = [{"max_tokens": 1024, "speculation": {"drafts": drafts}}]
    pinned = parse_job(doc)
    if refused:
        with pytest.raises(JobError, match=r"bucket 1024: speculation drafts 8 must be below the block \(8"):
            resolve_engine(pinned, **CPU)
    else:
        resolve_engine(pinned, **CPU)


def test_the_latent_split_runs_on_both_backends(checkpoints):
    setup = resolve_engine(job(checkpoints, "kimi", "mla", 2, context_parallel=True), **CPU)
    assert setup.context_parallel and "context_parallel=on" in setup.describe()
    assert not resolve_engine(job(checkpoints, "kimi", "mla", 2), **CPU).context_parallel  # off unless asked
    gpu = resolve_engine(job(checkpoints, "kimi_real", "mla_real", 2, context_parallel=True), **GPU)
    assert (gpu.backend, gpu.context_parallel) == ("flashinfer", True)


def test_pipeline_stages_need_a_layer_each_run_uncompiled_and_run_lanes_eagerly_on_flashinfer(checkpoints):
    (checkpoints / "two_layers").mkdir()
    (checkpoints / "two_layers" / "config.json").write_text(json.dumps(
        {"architectures": ["Qwen3ForCausalLM"], "head_dim": 128, "num_hidden_layers": 2}))
    assert resolve_engine(job(checkpoints, "two_layers", pp=2), **CPU).compile is False
    with pytest.raises(JobError, match="pipeline_parallel_size 3: the target has 2 layers and each stage needs one"):
        resolve_engine(job(checkpoints, "two_layers", pp=3), **CPU)
    with pytest.raises(JobError, match="pipeline_parallel_size > 1 is not compiled yet"):
        resolve_engine(job(checkpoints, pp=2, compile=True), **CPU)
    assert resolve_engine(job(checkpoints, pp=2, micro_batches=2), **CPU).backend == "torch"
    with pytest.raises(JobError, match="micro_batches 2: there are no pipeline stages to keep busy"):
        resolve_engine(job(checkpoints, micro_batches=2), **CPU)
    assert resolve_engine(job(checkpoints, pp=2), **GPU).cuda_graphs
    lanes = resolve_engine(job(checkpoints, pp=2, micro_batches=2), **GPU)  # flashinfer: rounds in lanes, eagerly
    assert lanes.backend == "flashinfer" and not lanes.cuda_graphs
    with pytest.raises(JobError, match="cuda_graphs: true cannot take effect: engine.micro_batches 2 on flashinfer "
                                       "runs rounds in lanes, eagerly"):
        resolve_engine(job(checkpoints, pp=2, micro_batches=2, cuda_graphs=True), **GPU)
    assert resolve_engine(job(checkpoints, pp=2, micro_batches=2, backend="torch"), **GPU).backend == "torch"


def expert_job(checkpoints, target="kimi", tp=1, **model):
    doc = job(checkpoints, target, "mla", tp).model_dump(mode="json")
    doc["model"].update(model)
    return parse_job(doc)


def test_experts_across_ranks_are_placed_or_refused_before_loading(checkpoints, tmp_path):
    """model.expert_parallel: the default placement over data_parallel_size x tensor_parallel_size
    ranks; a placement file that matches; refused, naming the field, on a dense target, on experts
    that do not split over the ranks, and for a placement file made for other ranks or replicas."""
    for name in ("kimi", "kimi_mxfp4"):
        config = json.loads((checkpoints / name / "config.json").read_text())
        config["text_config"]["num_experts"] = 8
        (checkpoints / name / "config.json").write_text(json.dumps(config))
    setup = resolve_engine(expert_job(checkpoints, tp=2, data_parallel_size=2, expert_parallel=True), **CPU)
    assert (setup.expert_placement.ranks, setup.expert_placement.slots) == (4, 2)
    # Rows agreed on the host each forward: a GPU runs such rounds eagerly, and refuses graphs asked for.
    gpu = resolve_engine(expert_job(checkpoints, "kimi_mxfp4", data_parallel_size=2, expert_parallel=True), **GPU)
    assert gpu.cuda_graphs is False and resolve_engine(expert_job(checkpoints, "kimi_mxfp4"), **GPU).cuda_graphs
    with pytest.raises(JobError, match="cuda_graphs: true cannot take effect: model.expert_parallel across"):
        doc = expert_job(checkpoints, "kimi_mxfp4", data_parallel_size=2, expert_parallel=True).model_dump(mode="json")
        doc["engine"]["cuda_graphs"] = True
        resolve_engine(parse_job(doc), **GPU)
    assert "expert_parallel=4 ranks x 2 slots" in setup.describe()
    assert resolve_engine(expert_job(checkpoints, tp=2), **CPU).expert_placement is None
    placement = Placement(8, 2, 1, {1: place(list(range(8)), 2, 1)})
    (tmp_path / "p.json").write_text(json.dumps(placement.to_json()))
    placed = resolve_engine(expert_job(checkpoints, data_parallel_size=2, expert_parallel=True, redundant_experts=1,
                                       expert_placement=str(tmp_path / "p.json")), **CPU)
    assert placed.expert_placement == placement
    for target, model, reason in [
        ("qwen3", dict(data_parallel_size=2, expert_parallel=True), "model.expert_parallel: .* no routed experts"),
        ("kimi", dict(data_parallel_size=3, expert_parallel=True), "8 routed experts do not split evenly over 3"),
        ("kimi", dict(data_parallel_size=4, expert_parallel=True, expert_placement=str(tmp_path / "p.json"),
                      redundant_experts=1), "p.json: it places 8 experts on 2 ranks"),
        ("kimi", dict(data_parallel_size=2, expert_parallel=True, expert_placement=str(tmp_path / "p.json")),
         "p.json: .* 1 replica slots each; .* model.redundant_experts 0"),
        ("kimi", dict(data_parallel_size=2, expert_parallel=True, expert_placement=str(tmp_path / "none.json")),
         "model.expert_placement: .*none.json"),
    ]:
        with pytest.raises(JobError, match=reason):
            resolve_engine(expert_job(checkpoints, target, **model), **CPU)


@pytest.mark.parametrize("model, reason", [
    (dict(data_parallel_size=2, pipeline_parallel_size=2), "data_parallel_size and model.pipeline_parallel_size"),
    (dict(redundant_experts=1), "redundant_experts places routed experts on ranks: it needs model.expert_parallel"),
    (dict(expert_placement="p.json"), "expert_placement places .* needs model.expert_parallel"),
    (dict(expert_parallel=True, pipeline_parallel_size=2), "expert_parallel does not run under pipeline stages"),
])
def test_expert_and_data_parallel_settings_that_do_not_combine_are_refused(checkpoints, model, reason):
    with pytest.raises(JobError, match=reason):
        expert_job(checkpoints, **model)
