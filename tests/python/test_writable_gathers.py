"""GatheredParameters(params, modifier_rank=r) writes what the block changed into the partitions:
read back through master_parameters() the values are exactly the written ones, and training on
equals plain PyTorch whose model was changed the same way between the same steps (its AdamW
states untouched, as Strata's are). Stage 0, 1 with cpu offload, 3 releasing every unit, and 3
with NVMe-resident states; two ranks with modifier ranks 0 and 1 in test_multirank.py's style.
"""


import pytest
import torch

import harness
import strata
from strata import InvalidArgumentError

CASES = {c[0]: c for c in harness.GRID}
BEFORE, AFTER = 2, 3


def edit(model, rank=0):
    """The change: a weight halved and an embedding row set (rank-dependent, so that two ranks
    that wrote their own values would disagree)."""
    with torch.no_grad():
        model.blocks[0].fc.weight.mul_(0.5)
        model.embed.tok.weight[3].fill_(0.25 + rank)


def edited_params(model):
    return [model.blocks[0].fc.weight, model.embed.tok.weight]


def reference(accum, clip, modifier=0, world=1):
    """Plain PyTorch whose model is edited (as rank `modifier` edits it) before step BEFORE."""
    torch.manual_seed(0)
    model = harness.MODELS["gpt2"]()
    opt = torch.optim.AdamW(model.parameters(), lr=harness.LR, weight_decay=harness.WEIGHT_DECAY)
    return harness.reference_loop(
        "gpt2", model, opt, BEFORE + AFTER, accum, clip, world=world,
        before_step=lambda step: edit(model, modifier) if step == BEFORE else None)


def gpt2_engine(case, nvme_dir):
    torch.manual_seed(0)
    model = harness.MODELS["gpt2"]()
    engine, _, _, _ = strata.initialize(model=model, model_parameters=model.parameters(),
                                        config=harness.config_for(case, nvme_dir))
    return engine, model


@pytest.mark.parametrize("name", ["stage0", "stage1_cpu", "stage3_cpu_release",
                                  "stage3_nvme_clip_accum"])
def test_a_written_gather_lands_in_the_partitions_and_trains_on(name, tmp_path):
    case = CASES[name]
    accum = case[4]
    engine, model = gpt2_engine(case, tmp_path / "nvme")
    losses = harness.run_steps(engine, "gpt2", 0, BEFORE, accum)
    names = [n for n, _ in model.named_parameters()]
    before = dict(zip(names, engine.master_parameters()))
    with strata.zero.GatheredParameters(edited_params(model), modifier_rank=0):
        edit(model)
    after = dict(zip(names, engine.master_parameters()))
    want_fc = before["blocks.0.fc.weight"] * 0.5
    want_tok = before["embed.tok.weight"].clone()
    want_tok[3] = 0.25
    assert torch.equal(after["blocks.0.fc.weight"], want_fc)
    assert torch.equal(after["embed.tok.weight"], want_tok)
    for n in names:  # nothing else moved
        if n not in ("blocks.0.fc.weight", "embed.tok.weight"):
            assert torch.equal(after[n], before[n]), n
    losses += harness.run_steps(engine, "gpt2", BEFORE, AFTER, accum)
    harness.assert_close(losses, reference(accum, case[5]))
    engine.close()


def test_without_modifier_rank_changes_are_dropped(tmp_path):
    engine, model = gpt2_engine(CASES["stage3"], tmp_path)
    before = [t.clone() for t in engine.master_parameters()]
    with strata.zero.GatheredParameters(edited_params(model)):
        edit(model)
    assert all(torch.equal(a, b) for a, b in zip(engine.master_parameters(), before))
    engine.close()


@pytest.mark.parametrize("name", ["stage0", "stage1_cpu", "stage3_cpu_release",
                                  "stage3_nvme_clip_accum"])
def test_a_block_that_replaces_a_tensor_is_refused_and_training_goes_on(name, tmp_path):
    """`p.data = other` (another dtype, another shape) inside a writable block left the
    parameter outside the engine's memory: the dtype was taken silently and every later step
    failed, the shape was refused and the engine broken for good. Now each is refused, the
    parameter keeps its own tensor, and training goes on exactly as if the block had not run."""
    case = CASES[name]
    accum = case[4]
    engine, model = gpt2_engine(case, tmp_path / "nvme")
    losses = harness.run_steps(engine, "gpt2", 0, BEFORE, accum)
    w = model.blocks[0].fc.weight
    for other in (lambda t: t.double() * 2, lambda t: torch.zeros(3, 3)):
        with pytest.raises(InvalidArgumentError, match=r"had their tensor replaced.*p\.copy_"):
            with strata.zero.GatheredParameters([w], modifier_rank=0):
                w.data = other(w.data)
    # A block that raises keeps its own error, and the parameter its tensor.
    with pytest.raises(KeyError, match="the block's own"):
        with strata.zero.GatheredParameters([w], modifier_rank=0):
            w.data = torch.zeros(3, 3)
            raise KeyError("the block's own")
    losses += harness.run_steps(engine, "gpt2", BEFORE, AFTER, accum)
    torch.manual_seed(0)
    plain = harness.MODELS["gpt2"]()
    opt = torch.optim.AdamW(plain.parameters(), lr=harness.LR, weight_decay=harness.WEIGHT_DECAY)
    harness.assert_close(losses, harness.reference_loop("gpt2", plain, opt, BEFORE + AFTER, accum,
                                                        case[5]))
    engine.close()


def test_a_modifier_rank_outside_the_world_is_refused(tmp_path):
    engine, model = gpt2_engine(CASES["stage3"], tmp_path)
    with pytest.raises(InvalidArgumentError, match="modifier_rank=1.*1 rank"):
        with strata.zero.GatheredParameters(edited_params(model), modifier_rank=1):
            pass
    with pytest.raises(InvalidArgumentError, match="modifier_rank=-1"):
        strata.zero.GatheredParameters(edited_params(model), modifier_rank=-1)
    engine.close()


@pytest.mark.skipif(not harness.have_gloo(),
                    reason="this build has no c10d Gloo (its headers were missing at build time)")
@pytest.mark.parametrize("modifier", [0, 1])
def test_two_ranks_take_the_modifier_ranks_values(modifier, tmp_path):
    ranks = harness.launch_two_ranks("writable_gather_worker.py", [modifier, tmp_path], tmp_path)
    # Both ranks hold the modifier's row after the write, whoever they are.
    for r in ranks:
        assert r["row3"] == pytest.approx([0.25 + modifier] * 32)
    # Each rank trained on its half of the global batch: the mean equals the whole-batch reference.
    want = reference(1, 0.0, modifier, world=2)
    got = [(a + b) / 2 for a, b in zip(ranks[0]["losses"], ranks[1]["losses"])]
    harness.assert_close(got, want)
