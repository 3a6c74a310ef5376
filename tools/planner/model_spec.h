// ModelSpec: what the planner needs to know about a model without building it — its trainable
// parameters in registration order (the order the engine packs them into chunks), which engine
// block each belongs to, and, for the GPT strata-train builds, the shapes that decide activation
// memory and FLOPs.
//
// Torch-free on purpose: strata-estimate and strata-tune (and their tests) must stay light; the
// GPT's parameter list is derived from ModelConfig with the same arithmetic as
// tools/train/gpt.cc. tests/tools/estimate_engine_test.cc checks it against a built model.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "runtime/base/config.h"
#include "runtime/base/status.h"

namespace strata::planner {

struct ParamSpec {
  std::string name;
  int64_t numel = 0;
  int64_t block = 0;  // engine unit the parameter belongs to (the first one holding it)
  std::vector<int64_t> also_in;  // later units sharing it (tied weights)
  // Its initial values are a draw the engine makes as it reads it (zero::StageGenerated): a
  // model built under zero::Init writes nothing of it to the staging file.
  bool generated = false;
};

struct ModelSpec {
  std::vector<ParamSpec> params;  // registration order
  int64_t num_blocks = 0;
  // Parameter ids in the order backward delivers their gradients (reverse order of use in
  // forward); empty: reverse registration order.
  std::vector<int64_t> gradient_order;
  // Set for the GPT of tools/train/gpt.h; absent for a model given only by its sizes.
  std::optional<ModelConfig> gpt;

  int64_t param_count() const;
  // Elements of the largest block (what one block's gradients take while backward is in it).
  int64_t largest_block_numel() const;
};

// The GPT of tools/train/gpt.h, parameter by parameter in LibTorch's named_parameters order:
// embedding (pos [T,d] — the module's own parameter comes before its children's — then tok
// [V,d]); per block ln1 w/b, ln2 w/b, qkv [3d,d]+[3d], proj [d,d]+[d], fc [4d,d]+[4d],
// out [d,4d]+[d] (children in registration order); head ln w/b, and the head shares tok.
// Fails on sizes < 1 or d_model not divisible by n_heads.
StatusOr<ModelSpec> GptModelSpec(const ModelConfig& c);

// A model known only by its size: `params` elements split into layers of at most
// `largest_layer` elements, one engine block per layer (the last one takes the remainder); at
// most a million layers.
StatusOr<ModelSpec> SyntheticModelSpec(int64_t params, int64_t largest_layer);

// Bytes autograd keeps from forward to backward for one micro-batch of `micro_batch` sequences
// through the GPT, with activations of `elem_size` bytes (2 for bf16/fp16, 4 for fp32).
// Counted per block: LayerNorm inputs and fp32 mean/rstd, each linear's input, the q/k/v
// projection output, the softmax output [B,h,T,T], the GELU input; dropout masks when
// dropout > 0; the head's logits and the fp32 log-softmax of the loss. See model_spec.cc
// Note [activation count]. With c.checkpoint_activations the blocks keep only their inputs and
// backward recomputes one block at a time (Note [checkpointed activations]); `inputs_on_host`
// (activation_checkpointing.cpu_checkpointing) moves those kept inputs off the device.
struct ActivationEstimate {
  uint64_t saved_bytes = 0;        // SUM: the device's peak of activations, all blocks
  uint64_t per_block_bytes = 0;    // one transformer block's full activations
  uint64_t head_bytes = 0;         // head + loss
  uint64_t kept_inputs_bytes = 0;  // checkpointing: every block's saved input (0 without it)
  bool checkpointed = false;
};
ActivationEstimate GptActivations(const ModelConfig& c, int64_t micro_batch, int elem_size,
                                  bool inputs_on_host = false);

// FLOPs of one micro-batch forward + backward of the GPT: 6 per parameter per token for the
// matmuls (2 forward, 4 backward) plus the attention score and value matmuls (12·L·T²·d per
// sequence). Embedding lookups and element-wise work are ignored.
double GptFlopsPerMicroBatch(const ModelConfig& c, int64_t micro_batch);

}  // namespace strata::planner
