"""deepspeed.pipe (Note [pipelines on one rank] in python/strata/pipe.py): a PipelineModule
trained with train_batch equals plain PyTorch on the same micro-batches; on two ranks as one
two-stage pipeline both ranks see the same data and return the one-rank losses bit for bit; as
two data-parallel groups of one stage they split the batch and return the whole batch's mean."""

import pytest
import torch

import harness
import strata
from strata import pipe

STEPS = 3
MICRO, GAS = 4, 2
SAMPLES = 64


def dataset():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(SAMPLES, 12, generator=g)
    y = torch.randint(0, 5, (SAMPLES,), generator=g)
    return torch.utils.data.TensorDataset(x, y)


def layers():
    # Specs, a module, a plain function and a tied pair, as DeepSpeed's pipelines mix them.
    return [pipe.LayerSpec(torch.nn.Linear, 12, 16), torch.nn.Tanh(),
            pipe.TiedLayerSpec("proj", torch.nn.Linear, 16, 16),
            lambda x: x * 0.5,
            pipe.TiedLayerSpec("proj", torch.nn.Linear, 16, 16),
            pipe.LayerSpec(torch.nn.Linear, 16, 5)]


def config():
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
            "zero_optimization": {"stage": 1}, "steps_per_print": 1}


def pipeline_engine(stages, **module_kwargs):
    torch.manual_seed(0)
    model = pipe.PipelineModule(layers(), num_stages=stages,
                                loss_fn=torch.nn.functional.cross_entropy, **module_kwargs)
    engine, _, loader, _ = strata.initialize(model=model, model_parameters=model.parameters(),
                                             training_data=dataset(), config=config())
    return engine, loader


def reference(micro_batches_of_step):
    """Plain PyTorch: the same layers built in the same order (so the same weights), AdamW,
    each step the mean gradient of its micro-batches; returns the mean loss per step."""
    torch.manual_seed(0)
    built, tied = [], {}
    for spec in layers():
        if isinstance(spec, pipe.TiedLayerSpec):  # built once per key, shared by its positions
            if spec.key not in tied:
                tied[spec.key] = spec.build()
            spec = tied[spec.key]
        built.append(spec.build() if isinstance(spec, pipe.LayerSpec) else spec)
    params = {id(p): p for m in built if isinstance(m, torch.nn.Module) for p in m.parameters()}
    opt = torch.optim.AdamW(list(params.values()), lr=1e-2, weight_decay=0.01)

    def forward(x):
        for layer in built:
            x = layer(x)
        return x
    losses = []
    for step in range(STEPS):
        batches = micro_batches_of_step(step)
        total = 0.0
        for x, y in batches:
            loss = torch.nn.functional.cross_entropy(forward(x), y)
            (loss / len(batches)).backward()
            total += loss.item() / len(batches)
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses


def _sampled(replicas, rank):
    sampler = torch.utils.data.distributed.DistributedSampler(dataset(), num_replicas=replicas,
                                                              rank=rank, shuffle=True)
    return list(torch.utils.data.DataLoader(dataset(), batch_size=MICRO, sampler=sampler))


def test_train_batch_matches_pytorch_and_eval_batch_reads_without_training(capsys):
    engine, _ = pipeline_engine(1)
    # Our own iterator, DeepSpeed's usual loop: train_batch pulls GAS micro-batches a step.
    batches = list(torch.utils.data.DataLoader(dataset(), batch_size=MICRO))
    it = iter(batches)
    got = [engine.train_batch(data_iter=it).item() for _ in range(STEPS)]
    want = reference(lambda s: batches[s * GAS:(s + 1) * GAS])
    harness.assert_close(got, want)
    assert "steps: 3 loss: " in capsys.readouterr().out  # DeepSpeed's line, steps_per_print 1
    assert engine.global_steps == STEPS and engine.train_batch_size() == MICRO * GAS
    assert (engine.num_stages, engine.stage_id, engine.is_first_stage(),
            engine.is_last_stage()) == (1, 0, True, True)
    masters = [p.clone() for p in engine.master_parameters()]
    loss, logits = engine.eval_batch(iter(batches), return_logits=True)
    assert logits.shape == (MICRO, 5) and torch.isfinite(loss)
    assert all(torch.equal(a, b) for a, b in zip(masters, engine.master_parameters()))
    assert engine.global_steps == STEPS  # evaluation does not step
    with pytest.raises(strata.InvalidArgumentError, match="Only train_batch"):
        engine(batches[0][0])
    with pytest.raises(strata.InvalidArgumentError, match="Only train_batch"):
        engine.backward(loss)
    engine.close()


def test_activation_checkpoint_intervals_train_the_same():
    # Every two layers recomputed in backward (DeepSpeed's default checkpoint function,
    # strata.checkpointing's here): the same losses as plain PyTorch.
    engine, _ = pipeline_engine(1, activation_checkpoint_interval=2)
    batches = list(torch.utils.data.DataLoader(dataset(), batch_size=MICRO))
    it = iter(batches)
    got = [engine.train_batch(data_iter=it).item() for _ in range(STEPS)]
    harness.assert_close(got, reference(lambda s: batches[s * GAS:(s + 1) * GAS]))
    engine.close()


def test_the_configs_pipeline_section_sets_the_checkpoint_interval(recwarn, capfd):
    torch.manual_seed(0)
    model = pipe.PipelineModule(layers(), num_stages=1, loss_fn=torch.nn.functional.cross_entropy)
    cfg = dict(config(), pipeline={"activation_checkpoint_interval": 3, "use_reentrant": False,
                                   "pipe_partitioned": True})
    engine, *_ = strata.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    assert model.activation_checkpoint_interval == 3
    assert "use_reentrant=false" in " ".join(str(w.message) for w in recwarn)
    assert "pipeline is accepted" not in capfd.readouterr().err  # the engine's log: not its key
    engine.close()
    cfg["pipeline"] = {"activation_checkpoint_interval": -1}
    torch.manual_seed(0)
    model = pipe.PipelineModule(layers(), num_stages=1, loss_fn=torch.nn.functional.cross_entropy)
    with pytest.raises(strata.InvalidArgumentError, match="activation_checkpoint_interval=-1"):
        strata.initialize(model=model, model_parameters=model.parameters(), config=cfg)


def test_state_dict_keys_are_deepspeeds_and_bad_layers_are_refused():
    model = pipe.PipelineModule(layers(), num_stages=1)
    keys = set(model.state_dict())
    assert {"0.weight", "5.bias", "tied_modules.proj.weight"} <= keys
    with pytest.raises(strata.InvalidArgumentError, match="layer 1 is a int"):
        pipe.PipelineModule([torch.nn.Linear(2, 2), 3], num_stages=1)
    with pytest.raises(strata.InvalidArgumentError, match="multiple of num_stages"):
        pipe.PipelineModule(layers(), num_stages=2)  # one rank here
    with pytest.raises(strata.InvalidArgumentError, match="num_stages or topology"):
        pipe.PipelineModule(layers())


@pytest.mark.skipif(not harness.have_gloo(),
                    reason="this build has no c10d Gloo (its headers were missing at build time)")
def test_two_stages_on_two_ranks_repeat_one_rank(tmp_path):
    ranks = harness.launch_two_ranks("pipe_worker.py", [2], tmp_path)
    # One pipeline group: dp 1, stages 0 and 1, the whole loader on each rank.
    assert [(r["dp_world_size"], r["stage_id"], r["dp_rank"]) for r in ranks] == [(1, 0, 0),
                                                                                  (1, 1, 0)]
    assert ranks[0]["train_batch_size"] == MICRO * GAS
    assert ranks[0]["batches"] == SAMPLES // MICRO
    assert ranks[0]["loss"] == ranks[1]["loss"]
    order = _sampled(1, 0)
    harness.assert_close(ranks[0]["loss"], reference(lambda s: order[s * GAS:(s + 1) * GAS]))


@pytest.mark.skipif(not harness.have_gloo(),
                    reason="this build has no c10d Gloo (its headers were missing at build time)")
def test_one_stage_on_two_ranks_splits_the_batch(tmp_path):
    ranks = harness.launch_two_ranks("pipe_worker.py", [1], tmp_path)
    assert [(r["dp_world_size"], r["stage_id"], r["dp_rank"]) for r in ranks] == [(2, 0, 0),
                                                                                  (2, 0, 1)]
    assert ranks[0]["train_batch_size"] == MICRO * GAS * 2
    assert ranks[0]["batches"] == SAMPLES // MICRO // 2
    assert ranks[0]["loss"] == ranks[1]["loss"]  # the dp mean, on every rank
    halves = [_sampled(2, 0), _sampled(2, 1)]
    want = reference(lambda s: halves[0][s * GAS:(s + 1) * GAS] + halves[1][s * GAS:(s + 1) * GAS])
    harness.assert_close(ranks[0]["loss"], want)
