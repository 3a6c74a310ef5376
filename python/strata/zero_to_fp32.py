"""strata.zero_to_fp32: a Strata checkpoint as one plain fp32 state_dict, without the ranks that
wrote it (DeepSpeed's `deepspeed.utils.zero_to_fp32`).

    python3 -m strata.zero_to_fp32 CHECKPOINT_DIR OUTPUT   # OUTPUT: a directory or a .bin/.pt

A checkpoint's rank files hold each rank's shard of every chunk's fp32 master, wherever the run
kept it (device, host or NVMe: save_checkpoint streams every tier into the files), and each
manifest says where every parameter lives (runtime/state/checkpoint.h, Manifest::layout). This module
puts the shards of every rank side by side and cuts the parameters out, one chunk at a time;
every block is read through the engine's own checked reader (its crc32c against the manifest).

What the state_dict holds: every parameter under its module path (a parameter shared by
several modules under each of its names, as the module's own state_dict has it) and the
persistent module buffers. Frozen parameters (requires_grad=False at initialize) are saved by
rank 0 in their working precision and come out as fp32 too, unless the checkpoint was saved, or
is read, with exclude_frozen_parameters=True; load_state_dict(..., strict=False) then keeps the
model's own values for them.
"""

import argparse
import collections
import errno
import glob
import json
import os
import sys

import torch

from . import _strata

_DTYPES = {"Float": torch.float32, "Double": torch.float64, "Half": torch.float16,
           "BFloat16": torch.bfloat16, "Long": torch.int64, "Int": torch.int32,
           "Short": torch.int16, "Char": torch.int8, "Byte": torch.uint8, "Bool": torch.bool}


class CheckpointError(ValueError):
    pass


def resolve_step_dir(checkpoint_dir, tag=None):
    """The directory holding rank-*.json: checkpoint_dir itself, or the one its `latest` files
    lead to (save_dir/latest names the tag, save_dir/<tag>/latest the step directory), each
    followed as the engine's load follows it (runtime/state/checkpoint.h ResolveCheckpointDir:
    a damaged `latest`, one naming a missing step or anything but a folder beside it, and a step
    a save moved aside are handled alike)."""
    d = os.fspath(checkpoint_dir)
    if tag is not None:
        tag = str(tag)
        if tag in ("", ".", "..") or "/" in tag or "\0" in tag:
            raise CheckpointError(f"--tag {tag!r} is not a tag: a tag is one folder name")
        d = os.path.join(d, tag)
        if not os.path.isdir(d):
            raise CheckpointError(f"{checkpoint_dir} holds no checkpoint tagged {tag!r} ({d} is "
                                  "not a directory)")
    for _ in range(3):
        if os.path.lexists(os.path.join(d, "rank-00000.json")):
            return d
        if not os.path.isdir(d) or not os.path.lexists(os.path.join(d, "latest")):
            break
        try:
            d = _strata.resolve_checkpoint_dir(d)
        except _strata.StrataError as e:
            raise CheckpointError(str(e)) from None
    raise CheckpointError(f"{checkpoint_dir}: no Strata checkpoint there (no rank-*.json and no "
                          "`latest` file leading to one); pass the directory save_checkpoint "
                          "wrote")


class Fp32Checkpoint:
    """The manifests of one saved step, read once."""

    def __init__(self, step_dir, exclude_frozen_parameters=False):
        self.dir = step_dir
        self.exclude_frozen = exclude_frozen_parameters
        paths = sorted(glob.glob(os.path.join(step_dir, "rank-*.json")))
        self.manifests = []
        for path in paths:
            try:
                # The engine's own checks: a regular file, the format's version, every field's
                # type and range (a future version, or a manifest without its rank, is refused).
                text = _strata.read_checkpoint_file(path)
                _strata.check_manifest(text, path)
                m = json.loads(text)
            except _strata.StrataError as e:
                raise CheckpointError(str(e)) from None
            except ValueError as e:  # JSONDecodeError, and bad UTF-8
                raise CheckpointError(f"{path}: not valid JSON ({e}); the manifest is "
                                      "damaged") from None
            self.manifests.append(m)
        if not self.manifests:
            raise CheckpointError(f"{step_dir}: no rank-*.json manifest")
        world = self.manifests[0].get("world_size")
        if not isinstance(world, int) or world < 1:
            raise CheckpointError(f"{paths[0]}: world_size={world!r} is not a rank count; the "
                                  "manifest is damaged")
        ranks = sorted(m["rank"] for m in self.manifests)
        if len(ranks) != world or ranks != list(range(world)):  # no list of a damaged count
            raise CheckpointError(f"{step_dir}: has the manifests of ranks {ranks} of a world of "
                                  f"{world}; every rank's file is needed")
        self.layout = self.manifests[0].get("layout")
        if not self.layout:
            raise CheckpointError(f"{step_dir}: written before checkpoints recorded their layout; "
                                  "load it with engine.load_checkpoint and save it again")

    def _chunk_master(self, chunk):
        """The full fp32 master of `chunk`, every rank's shard in its place."""
        full = torch.zeros(self.layout["chunk_numel"][chunk], dtype=torch.float32)
        ranges = []
        for m in self.manifests:
            block = next((b for b in m["blocks"]
                          if b["chunk"] == chunk and b["state"] == "master32"), None)
            if block is None:
                raise CheckpointError(f"{self.dir}: rank {m['rank']} has no master of chunk "
                                      f"{chunk}")
            # A bf16 master (bf16_master_weights_and_grads) is saved as its bf16 bits.
            bf16 = m.get("state_dtype", "").endswith("+bf16_master")
            values = _read(self.dir, m["rank"], block, torch.bfloat16 if bf16 else torch.float32,
                           f"chunk {chunk}'s master32").to(torch.float32)
            start = m["layout"]["shard_offset"][chunk]
            want = m["shard_numel"][chunk]
            if values.numel() != want or start + want > full.numel():
                # a block cut short (bytes: 0 included) would leave zeros in its place
                raise CheckpointError(
                    f"{self.dir}: rank {m['rank']}'s master of chunk {chunk} holds "
                    f"{values.numel()} values where its manifest's shard_numel says {want} at "
                    f"offset {start} of {full.numel()}; the manifest is damaged")
            full[start:start + values.numel()] = values
            ranges.append((start, want))
        end = 0
        for start, want in sorted(ranges):  # the shards tile the chunk, or zeros would show
            if start != end:
                raise CheckpointError(f"{self.dir}: the ranks' shards of chunk {chunk} leave "
                                      f"elements {end} to {start} unread; the manifests are "
                                      "damaged")
            end = start + want
        if end != full.numel():
            raise CheckpointError(f"{self.dir}: the ranks' shards of chunk {chunk} end at element "
                                  f"{end} of {full.numel()}; the manifests are damaged")
        return full

    def state_dict(self):
        """Every parameter and persistent buffer; a manifest whose fields are missing, of the
        wrong type or out of range raises CheckpointError naming the directory (the engine's own
        loader refuses such manifests too)."""
        try:
            return self._state_dict()
        except CheckpointError:
            raise
        except (KeyError, IndexError, TypeError, ValueError, RuntimeError) as e:
            raise CheckpointError(f"{self.dir}: a manifest is damaged ({type(e).__name__}: {e}); "
                                  "it does not describe the rank files") from None

    def _state_dict(self):
        out = collections.OrderedDict()
        by_chunk = collections.defaultdict(list)
        for p in self.layout["params"]:
            by_chunk[p["chunk"]].append(p)
        for chunk in sorted(by_chunk):
            full = self._chunk_master(chunk)
            for p in by_chunk[chunk]:
                numel = 1
                for d in p["shape"]:
                    numel *= d
                out[p["name"]] = full[p["offset"]:p["offset"] + numel].clone().view(p["shape"])
        m0 = self.manifests[0]
        if not self.exclude_frozen:
            shapes = {p["name"]: p["shape"] for p in self.layout.get("frozen", [])}
            for p in m0.get("frozen", []):
                values = _read(self.dir, 0, p, _DTYPES[p["dtype"]], f"frozen parameter "
                               f"'{p['name']}'")
                if values.is_floating_point():
                    values = values.to(torch.float32)
                out[p["name"]] = values.view(shapes.get(p["name"], [values.numel()]))
        keys = m0.get("extra", {}).get("module_keys")
        if keys:  # the module's own state_dict names (Python engines record them)
            for alias, name in keys["aliases"].items():
                if name in out:
                    out[alias] = out[name]
        shapes = {b["name"]: b["shape"] for b in self.layout.get("buffers", [])}
        for b in m0.get("buffers", []):
            if keys and b["name"] not in keys["buffers"]:
                continue  # not persistent: not part of the module's state_dict
            values = _read(self.dir, 0, b, _DTYPES[b["dtype"]], f"buffer '{b['name']}'")
            out[b["name"]] = values.view(shapes.get(b["name"], [values.numel()]))
        return out


def _read(step_dir, rank, entry, dtype, what):
    """A block or buffer of a rank's state file, checked against the crc32c its manifest
    recorded, by the same reader the engine's load_checkpoint uses (runtime/state/checkpoint.h):
    a short or damaged file is refused naming it."""
    path = os.path.join(step_dir, f"rank-{rank:05d}.bin")
    nbytes = entry["bytes"]
    if nbytes == 0:
        return torch.empty(0, dtype=dtype)
    try:
        data = _strata.read_checked(path, entry["offset"], nbytes, entry["crc32c"], what)
    except _strata.StrataError as e:
        raise CheckpointError(str(e)) from None
    return torch.frombuffer(bytearray(data), dtype=dtype)


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag=None,
                                             exclude_frozen_parameters=False, lazy_mode=False):
    """The checkpoint's fp32 weights as an OrderedDict name -> tensor, on the CPU; frozen
    parameters too unless exclude_frozen_parameters."""
    return Fp32Checkpoint(resolve_step_dir(checkpoint_dir, tag),
                          exclude_frozen_parameters).state_dict()


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir, output_dir_or_file, tag=None,
                                               exclude_frozen_parameters=False,
                                               safe_serialization=False, max_shard_size=None):
    """Writes the fp32 state_dict with torch.save: to OUTPUT/pytorch_model.bin when OUTPUT is a
    directory (or has no extension), else to OUTPUT itself. Returns the path written."""
    if safe_serialization:
        raise CheckpointError("safe_serialization=True: safetensors is not available with "
                              "Strata; the output is a torch.save file")
    step_dir = resolve_step_dir(checkpoint_dir, tag)
    out = _output_path(os.fspath(output_dir_or_file), os.fspath(checkpoint_dir), step_dir)
    state = Fp32Checkpoint(step_dir, exclude_frozen_parameters).state_dict()
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    tmp = out + ".tmp"
    with open(tmp, "wb", buffering=0) as f:
        sink = _WriteOnce(f)
        try:
            torch.save(state, sink)
        finally:
            if sink.error is not None:
                f.close()
                os.unlink(tmp)  # a full disk leaves no partial file behind
    if sink.error is not None:
        raise OSError(sink.error.errno, f"writing {out}: {sink.error.strerror}")
    _strata.publish_file(tmp, out)
    return out


class _WriteOnce:
    """The file torch.save writes through. The first failed write (ENOSPC) is kept and every
    later one is taken as written: torch's zip writer that sees a failure writes its end of file
    again from its destructor, and a second failure there aborts the process."""

    def __init__(self, f):
        self._f = f
        self.error = None

    def write(self, data):
        if self.error is None:
            view = memoryview(data).cast("B")
            try:
                while view:
                    n = self._f.write(view)
                    if not n:
                        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                    view = view[n:]
            except OSError as e:
                self.error = e
        return len(memoryview(data).cast("B"))

    def flush(self):
        pass


def _output_path(out, checkpoint_dir, step_dir):
    """The file to write: OUTPUT/pytorch_model.bin when OUTPUT is a directory (or has no
    extension), else OUTPUT. Never a file of the checkpoint being read: inside its step
    directory, or a `latest` that leads to it (the conversion would destroy its own input)."""
    given = out
    if os.path.isdir(out) or not os.path.splitext(out)[1]:
        out = os.path.join(out, "pytorch_model.bin")
    step = os.path.realpath(step_dir)
    guarded = [os.path.realpath(os.path.join(checkpoint_dir, "latest"))]
    parent = os.path.dirname(step)
    while parent and parent != os.path.dirname(parent) and len(guarded) < 4:
        guarded.append(os.path.join(parent, "latest"))
        parent = os.path.dirname(parent)
    for path in (given, out):
        real = os.path.realpath(path)
        if real == step or real.startswith(step + os.sep) or real in guarded:
            raise CheckpointError(f"the output {given} is a file of the checkpoint being "
                                  f"converted ({step_dir}); write it outside the checkpoint's "
                                  "folder")
    return out


def load_state_dict_from_zero_checkpoint(model, checkpoint_dir, tag=None):
    """Loads the checkpoint's fp32 weights into `model` (a plain module, on the CPU) and returns
    it. Parameters the checkpoint lacks (frozen ones it was saved without) keep their values."""
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    model = model.cpu()
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected:
        raise CheckpointError(f"the checkpoint has weights the model lacks: {unexpected[:5]}")
    return model


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="zero_to_fp32",
        description="Writes a Strata (ZeRO) checkpoint's weights as one fp32 torch state_dict, "
                    "without the ranks that saved it.")
    parser.add_argument("checkpoint_dir", help="the directory save_checkpoint wrote (its "
                        "`latest` file picks the step), or a tag or step directory inside it")
    parser.add_argument("output", help="a directory (pytorch_model.bin is written in it) or a "
                        "file name")
    parser.add_argument("-t", "--tag", default=None, help="the checkpoint tag (default: latest)")
    parser.add_argument("--exclude_frozen_parameters", action="store_true",
                        help="leave out the frozen parameters the checkpoint holds")
    args = parser.parse_args(argv)
    try:
        path = convert_zero_checkpoint_to_fp32_state_dict(
            args.checkpoint_dir, args.output, tag=args.tag,
            exclude_frozen_parameters=args.exclude_frozen_parameters)
    except (CheckpointError, OSError) as e:
        print(f"zero_to_fp32: {e}", file=sys.stderr)
        return 2
    except MemoryError:
        print("zero_to_fp32: out of host memory while reading the checkpoint (the state_dict "
              "is built whole in memory)", file=sys.stderr)
        return 1
    print(f"zero_to_fp32: wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
