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


def pipeline_engine(stages, initial=None, **module_kwargs):
    """A PipelineModule of layers() trained by a Strata engine; `initial` (a dict) receives its
    starting weights by name."""
    torch.manual_seed(0)
    model = pipe.PipelineModule(layers(), num_stages=stages,
                                loss_fn=torch.nn.functional.cross_entropy, **module_kwargs)
    if initial is not None:
        initial.update({n: p.detach().clone() for n, p in model.named_parameters()})
    engine, _, loader, _ = strata.initialize(model=model, model_parameters=model.parameters(),
                                             training_data=dataset(), config=config())
    return engine, loader


def reference(micro_batches_of_step, initial=None):
    """Plain PyTorch: the same layers built in the same order (so a one-stage pipeline's
    weights) or given `initial` weights by DeepSpeed's names, AdamW, each step the mean gradient
    of its micro-batches; returns the mean loss per step."""
    torch.manual_seed(0)
    for spec in layers():  # DeepSpeed's "parameters" partitioning builds each spec once first
        if isinstance(spec, pipe.LayerSpec):
            spec.build()
    built, tied, names = [], {}, []
    for idx, spec in enumerate(layers()):
        names.append(f"tied_modules.{spec.key}." if isinstance(spec, pipe.TiedLayerSpec) else f"{idx}.")
        if isinstance(spec, pipe.TiedLayerSpec):  # built once per key, shared by its positions
            if spec.key not in tied:
                tied[spec.key] = spec.build()
            spec = tied[spec.key]
        built.append(spec.build() if isinstance(spec, pipe.LayerSpec) else spec)
    if initial is not None:
        with torch.no_grad():
            for prefix, m in zip(names, built):
                if isinstance(m, torch.nn.Module):
                    for name, p in m.named_parameters():
                        p.copy_(torch.tensor(initial[prefix + name]).view_as(p))
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
    # DeepSpeed's pipeline loader: the data in order over the dp groups.
    sampler = torch.utils.data.distributed.DistributedSampler(dataset(), num_replicas=replicas,
                                                              rank=rank, shuffle=False)
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


# Stage boundaries DeepSpeed 0.19.6's partition_balanced and partition_uniform return for these
# inputs (run in the peer root, ../shared/peers/deepspeed-cpu): they decide which layers a stage
# builds from the same random state, so they must be DeepSpeed's.
BALANCED = [([1, 2, 3, 4, 5, 6, 7, 8], 3, [0, 4, 6, 8]), ([5, 5, 5, 5], 3, [0, 2, 3, 4]),
            ([10, 1, 1, 1, 1, 10], 2, [0, 3, 6]), ([0, 0, 7, 0], 2, [0, 3, 4]),
            ([3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5], 4, [0, 5, 7, 9, 11]), ([208, 0, 85], 2, [0, 2, 3]),
            ([1, 1], 3, [0, 1, 2, 2])]


def test_stage_boundaries_are_deepspeeds():
    for weights, parts, want in BALANCED:
        assert pipe._balanced_parts(weights, parts) == want, (weights, parts)
    assert pipe._uniform_parts(10, 3) == [0, 4, 7, 10] and pipe._uniform_parts(2, 3) == [0, 1, 2, 2]
    by_type = pipe.PipelineModule(layers(), num_stages=1, partition_method="type:linear")
    assert by_type.partitions() == [0, 6]
    with pytest.raises(strata.InvalidArgumentError, match="no layer's type matches"):
        pipe.PipelineModule(layers(), num_stages=1, partition_method="type:Conv2d")
    with pytest.raises(strata.InvalidArgumentError, match="'parameters', 'uniform' or 'type:"):
        pipe.PipelineModule(layers(), num_stages=1, partition_method="profile")


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
    # Each stage's layers were built from the same random state, as on DeepSpeed's stage ranks
    # (Note [the weights of a pipeline]), so the weights are not one process's sequence: the
    # reference starts from them.
    assert ranks[0]["initial"] == ranks[1]["initial"]
    order = _sampled(1, 0)
    harness.assert_close(ranks[0]["loss"], reference(lambda s: order[s * GAS:(s + 1) * GAS],
                                                     ranks[0]["initial"]))


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
    want = reference(lambda s: halves[0][s * GAS:(s + 1) * GAS] + halves[1][s * GAS:(s + 1) * GAS],
                     ranks[0]["initial"])
    harness.assert_close(ranks[0]["loss"], want)
