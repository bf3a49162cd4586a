"""The engine on Kimi-K3 + DFlash2-MLA: speculative greedy == target-only greedy for both tap
streams; target-only greedy == argmax decoding with the fp64 reference; recurrent state slots
reused by later sequences start clean; TP2 == TP1; build refuses drafters that do not fit.
(The sampled-output law is in test_kimi_engine_sampling.py.)"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from dflash_batch.build import build_engine
from dflash_batch.engine.pair import check_pair
from dflash_batch.engine.engine import Engine
from dflash_batch.job import JobError, parse_job
from dflash_batch.models.loader import load_model
from dflash_batch.models.registry import model_class
from tests import engine_tp_worker
from tests.engine_util import F64, after_first, bucket, random_prompts, run
from dflash_batch.testing.kimi_pair import BLOCK, TAPS, VOCAB, load_pair, make_kimi_pair
from tests.kimi_reference import load_reference, reference_forward
from tests.test_tp import free_port
from dflash_batch.testing.kimi import make_kimi_checkpoint

STREAMS = ["prefix", "attn_res"]
# Mixed lengths: 1 (shorter than every window and page), and longer than the drafter's window (6)
# and the page (16).
LENGTHS = [37, 1, 60, 7, 22, 3, 50, 12]


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    d = tmp_path_factory.mktemp("kimi_pairs")
    return {s: make_kimi_pair(d / s, stream=s) for s in STREAMS}


@pytest.mark.numerics
# -- greedy ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("batch", [1, 3, 8])
@pytest.mark.parametrize("stream", STREAMS)
def test_speculative_greedy_equals_target_greedy(pairs, stream, batch):
    """float64: in float32 the verify's and the decode's logits may round a near-tie apart."""
    target, drafter = load_pair(*pairs[stream], F64)
    assert target.tap_stream == stream
    engine = Engine(target, drafter, dtype=F64)
    prompts = random_prompts(LENGTHS[:batch], vocab=VOCAB, seed=batch)
    spec = run(engine, prompts, bucket(), max_new_tokens=24)
    plain = run(engine, prompts, bucket(speculation=False), max_new_tokens=24)
    assert [c.token_ids for c in spec] == [c.token_ids for c in plain]
    rounds = [c.spec.per_round for c in spec]
    assert sum(map(sum, rounds)) > 0, "no draft accepted"
    # A round that kept some drafts but not all, followed by another round: the next verify
    # starts from a KDA state committed at a length between 1 and B.
    assert any(0 < n < BLOCK - 1 for r in rounds for n in r[:-1]), rounds


@pytest.mark.numerics
def test_target_only_greedy_matches_fp64_reference(tmp_path):
    # The unpeaked head: its argmax wanders over the vocabulary, so every step's token depends
    # on the whole KDA state and MLA cache.
    path = make_kimi_checkpoint(tmp_path / "kimi")
    prompt = random_prompts([21], vocab=VOCAB, seed=3)[0]
    new = 8
    got = run(Engine(load_model(path)), [prompt], bucket(speculation=False), max_new_tokens=new)[0].token_ids

    ref, seq = load_reference(path), list(prompt)
    for _ in range(new):
        logits = reference_forward(ref, seq, [])[0][-1]
        top = logits.topk(2).values
        assert top[0] - top[1] > 1e-3, "near tie: fp32 and fp64 may rightly disagree; pick another prompt"
        seq.append(int(logits.argmax()))
    assert got == seq[len(prompt):]


@pytest.mark.numerics
def test_logprobs_are_the_fp64_references_log_softmax(pairs):
    """Speculative decoding with logprobs: every generated token's (drafted or not) and every
    prompt token's logprob and top-k equal log_softmax(logits / temperature) of the fp64
    reference run over prompt + output."""
    target_dir, drafter_dir = pairs["prefix"]
    engine = Engine(*load_pair(target_dir, drafter_dir, F64), dtype=F64, max_num_batched_tokens=16)
    prompts = random_prompts([9, 30, 2], vocab=VOCAB, seed=7)
    got = run(engine, prompts, bucket(), max_new_tokens=16, temperature=0.8, logprobs=4, prompt_logprobs=3)
    assert sum(n for c in got for n in c.spec.per_round) > 0, "no draft accepted"
    ref = load_reference(target_dir)
    for prompt, c in zip(prompts, got):
        logits = reference_forward(ref, prompt + c.token_ids, [])[0]
        want = torch.log_softmax(logits / torch.tensor(0.8, dtype=torch.float32).double(), -1)
        n = len(prompt)
        for lp, at, tokens in ((c.logprobs, want[n - 1:-1], c.token_ids),
                               (after_first(c.prompt_logprobs), want[:n - 1], prompt[1:])):
            assert len(lp.token) == len(tokens)
            if not tokens:
                continue
            torch.testing.assert_close(torch.tensor(lp.token, dtype=F64),
                                       at.gather(-1, torch.tensor(tokens)[:, None])[:, 0], atol=1e-6, rtol=1e-6)
            assert lp.top_ids == at.topk(4 if lp is c.logprobs else 3).indices.tolist()
            torch.testing.assert_close(torch.tensor(lp.top, dtype=F64), at.topk(len(lp.top[0])).values,
                                       atol=1e-6, rtol=1e-6)


@pytest.mark.numerics
def test_state_slots_start_clean_when_reused(pairs):
    # max_num_seqs=1 runs the prompts one after another in the same recurrent-state slot;
    # each must decode as it does in a batch, where every prompt has a fresh slot.
    engine = Engine(*load_pair(*pairs["prefix"], F64), dtype=F64)
    prompts = random_prompts([9, 30, 2, 17], vocab=VOCAB, seed=5)
    batched = run(engine, prompts, bucket(max_num_seqs=4), max_new_tokens=12)
    alone = run(engine, prompts, bucket(max_num_seqs=1), max_new_tokens=12)
    assert [c.token_ids for c in alone] == [c.token_ids for c in batched]
    assert [c.spec.per_round for c in alone] == [c.spec.per_round for c in batched]


# -- tensor parallel -------------------------------------------------------------------------------
# no_rerun: each rank runs one torch thread whatever OMP_NUM_THREADS says, so CI's two-thread rerun
# of the numerics would only repeat this.
@pytest.mark.numerics
@pytest.mark.slow
@pytest.mark.no_rerun
@pytest.mark.parametrize("graphs,latent_split", [(False, False), (True, False), (False, True), (True, True)],
                         ids=["eager", "graphs", "eager, latent split", "graphs, latent split"])
def test_tp2_equals_tp1(tmp_path, graphs, latent_split):
    # Each rank holds 2 of 4 KDA heads, 2 of 4 MLA heads (target and drafter), half of every
    # expert's intermediate width (32 columns of each packed MXFP4 w2: whole scale groups) and 48
    # of the 96 vocabulary rows, each half holding likely tokens (`slices`), so greedy tokens and
    # the drafter's candidates come from both ranks. `graphs`: the ranks run the engine's graph path
    # (captures and replays emulated: tests/emulated_graphs.py), against one process decoding eagerly.
    # The ranks gather and sample the verify rows of two sequences at a time (engine/choice.py; 3
    # sequences: an uneven last group), the one process all at once. `latent_split`: each rank keeps
    # the MLA latents (target's, drafter's, its rings of 6 + 8 positions) of every other position:
    # prompts of 1, 37 and 20 tokens (ranks keep unequal counts), 3 to 5 pages of 16 a sequence.
    target, drafter = make_kimi_pair(tmp_path / "pair", stream="attn_res", moe_intermediate_size=64, slices=2)
    prompts = random_prompts([1, 37, 20], vocab=VOCAB, seed=6)
    runs = {"greedy": dict(max_new_tokens=24),
            "sampled": dict(max_new_tokens=24, temperature=1.0, top_p=0.95),
            "logprobs": dict(max_new_tokens=12, temperature=0.8, top_k=5, logprobs=2)}
    engine_tp_worker.assert_tp2_equals_tp1(str(target), str(drafter), prompts, runs, str(tmp_path), free_port(),
                                           graphs, group_rows=16, latent_split=latent_split)


@pytest.mark.numerics
@pytest.mark.slow
@pytest.mark.no_rerun
def test_tp4_latent_split_equals_tp1(tmp_path):
    # Four ranks each keep every fourth position's MLA latents: one of 4 MLA and KDA heads a rank,
    # 32 of each expert's 128 intermediate columns (a whole MXFP4 scale group), 80 of 320
    # vocabulary rows, each slice holding likely tokens. Prompts of 2, 45 and 23 tokens.
    target, drafter = make_kimi_pair(tmp_path / "pair", stream="attn_res", vocab_size=320, moe_intermediate_size=128,
                                     slices=4)
    prompts = random_prompts([2, 45, 23], vocab=320, seed=7)
    runs = {"greedy": dict(max_new_tokens=20),
            "logprobs": dict(max_new_tokens=12, temperature=0.8, top_p=0.9, logprobs=2)}
    engine_tp_worker.assert_tp2_equals_tp1(str(target), str(drafter), prompts, runs, str(tmp_path), free_port(),
                                           ranks=4, latent_split=True)



@pytest.mark.numerics
@pytest.mark.slow
@pytest.mark.no_rerun
def test_tp2_latent_split_on_flashinfer_equals_tp1(tmp_path):
    # The flashinfer backend's split (backends/flashinfer_split.py; its MLA wrapper emulated) through
    # the engine's graph path, rounds planned as captured ones are (one wrapper sequence a query,
    # fixed buffers), prefill chunks eagerly (chains of queries two apart): against one process on
    # the torch backend. A window of 10 (flashinfer's latent path wants one no shorter than the
    # block); the drafter's rings wrap. The wrapper's log-sum-exps are float32: logprobs to 1e-6.
    # The last two prompts share a 70-token head (plan/heads.py): the ranks keep it (its KDA
    # states, each rank's share of its latents and partial page, the rings) and the second
    # starts there; one process prefills both whole.
    target, drafter = make_kimi_pair(tmp_path / "pair", stream="attn_res", moe_intermediate_size=64, slices=2,
                                     window=10)
    head = random_prompts([70], vocab=VOCAB, seed=7)[0]
    prompts = random_prompts([1, 37, 20], vocab=VOCAB, seed=6) + [head + t for t in random_prompts(
        [5, 12], vocab=VOCAB, seed=8)]
    runs = {"greedy": dict(max_new_tokens=24),
            "logprobs": dict(max_new_tokens=12, temperature=0.8, top_k=5, logprobs=2)}
    engine_tp_worker.assert_tp2_equals_tp1(str(target), str(drafter), prompts, runs, str(tmp_path), free_port(),
                                           graphs=True, latent_split=True, backend="flashinfer", logprob_atol=1e-6,
                                           cached=[0, 0, 0, 0, 70])


@pytest.mark.numerics
@pytest.mark.no_rerun
def test_tp2_latent_split_shares_a_head_whose_rows_have_short_tails(tmp_path):
    # Three prompts share a 70-token head and end 5, 1 and 3 tokens past it, inside the drafter's
    # window (6): the first drafts of the rows that enter the head read the ring rows kept at its
    # end (each rank's share of them), which their own tails do not rewrite. Eager, torch backend.
    target, drafter = make_kimi_pair(tmp_path / "pair", stream="attn_res", moe_intermediate_size=64, slices=2)
    head = random_prompts([70], vocab=VOCAB, seed=7)[0]
    prompts = [head + t for t in random_prompts([5, 1, 3], vocab=VOCAB, seed=8)]
    engine_tp_worker.assert_tp2_equals_tp1(str(target), str(drafter), prompts, {"greedy": dict(max_new_tokens=16)},
                                           str(tmp_path), free_port(), latent_split=True, cached=[0, 70, 70])


@pytest.mark.slow
@pytest.mark.no_rerun
def test_tp2_auto_with_the_latent_split_decodes_what_one_process_does(tmp_path):
    # speculation: auto with the latents split: rank 0's costs rise with the drafts verified, so
    # its plan verifies fewer than the block where acceptance is low (here rounds of width 1 and of
    # the whole block run through the split, 40 and 29 of them); rank 1's disagree and are not
    # followed. Greedy tokens == one process's.
    target, drafter = make_kimi_pair(tmp_path / "pair", stream="attn_res", moe_intermediate_size=64, slices=2)
    prompts = random_prompts([1, 37, 20], vocab=VOCAB, seed=6)
    costs = [[1.0 + 0.4 * k for k in range(8)], [1.0] + [100.0] * 7]
    engine_tp_worker.assert_auto_ranks_agree(str(target), str(drafter), prompts, str(tmp_path), free_port(), costs,
                                             latent_split=True)

# -- pairing ---------------------------------------------------------------------------------------
def drafter_with(drafter_dir, **changes):
    """The pair's drafter built (unloaded) from its config with top-level or dflash_config changes."""
    config = json.loads((drafter_dir / "config.json").read_text())
    for key, value in changes.items():
        if key in config["dflash_config"]:
            config["dflash_config"][key] = value
        else:
            config[key] = value
    return model_class(config)(config)


@pytest.mark.parametrize("change, message", [
    (dict(hidden_size=32), "hidden_size 32 != target's 64"),
    (dict(vocab_size=128), "vocab_size 128 != target's 96"),
    (dict(target_layer_ids=[1, 8]), r"target_layer_ids \[1, 8\]"),
    (dict(target_layer_ids=[3, 3]), r"target_layer_ids \[3, 3\]"),
    (dict(mask_token_id=96), "mask_token_id 96"),
], ids=["hidden", "vocab", "layer_out_of_range", "layer_twice", "mask"])
def test_check_pair_refuses_drafter_that_does_not_fit(pairs, change, message):
    target_dir, drafter_dir = pairs["prefix"]
    target = load_model(target_dir)
    check_pair(target, drafter_with(drafter_dir))  # the pair itself fits
    with pytest.raises(ValueError, match=message):
        check_pair(target, drafter_with(drafter_dir, **change))


def job_for(target_dir, drafter_dir):
    # build_engine reads only the model section; the input files need not exist.
    return parse_job(dict(input=dict(paths=["prompts.jsonl"], input_ids_column="ids"),
                          model=dict(target=str(target_dir), drafter=str(drafter_dir), dtype="float32"),
                          engine=dict(backend="torch"), output=dict(dir="out")))


@pytest.mark.parametrize("stream", STREAMS)
def test_build_engine_names_the_tap_stream(pairs, stream, capsys):
    engine = build_engine(job_for(*pairs[stream]), SimpleNamespace(decode=lambda ids: "", vocab_size=1))
    assert engine.target.tap_stream == stream
    assert f"taps: layers={tuple(TAPS)} stream={stream}" in capsys.readouterr().err


@pytest.mark.parametrize("stream", ["residual", "mix"])
def test_build_engine_refuses_unknown_stream(pairs, tmp_path, stream):
    target_dir, drafter_dir = pairs["attn_res"]
    bad = tmp_path / "drafter"
    bad.mkdir()
    config = json.loads((drafter_dir / "config.json").read_text())
    config["dflash_config"]["aux_hidden_stream"] = stream
    (bad / "config.json").write_text(json.dumps(config))
    (bad / "model.safetensors").symlink_to(drafter_dir / "model.safetensors")
    with pytest.raises(JobError, match=f"aux_hidden_stream must be prefix or attn_res, got '{stream}'"):
        build_engine(job_for(target_dir, bad), SimpleNamespace(decode=lambda ids: "", vocab_size=1))
