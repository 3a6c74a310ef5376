#include "runtime/state/state_layout.h"

#include <algorithm>
#include <cstring>

namespace strata {

optim::MomentFormat StateLayout::MomentsOf(StateDtype dtype) {
  switch (dtype) {
    case StateDtype::kFp32: return optim::MomentFormat::kFp32;
    case StateDtype::kBf16: return optim::MomentFormat::kBf16;
    case StateDtype::kInt8: return optim::MomentFormat::kInt8;
  }
  return optim::MomentFormat::kFp32;
}

std::string StateLayout::Name() const {
  return StrCat(optim::MomentFormatName(moments), bf16_master ? "+bf16_master" : "");
}

StatusOr<StateLayout> StateLayout::Parse(const std::string& name) {
  StateLayout l;
  std::string moments = name;
  const std::string suffix = "+bf16_master";
  if (moments.size() > suffix.size() && moments.compare(moments.size() - suffix.size(), suffix.size(), suffix) == 0) {
    l.bf16_master = true;
    moments.resize(moments.size() - suffix.size());
  }
  if (moments == "fp32") l.moments = optim::MomentFormat::kFp32;
  else if (moments == "bf16") l.moments = optim::MomentFormat::kBf16;
  else if (moments == "int8") l.moments = optim::MomentFormat::kInt8;
  else
    return InvalidArgument(StrCat("state layout \"", name, "\": expected fp32, bf16 or int8, "
                                  "optionally followed by +bf16_master"));
  return l;
}

uint64_t StateLayout::Bytes(StateKind kind, int64_t n) const {
  const uint64_t u = static_cast<uint64_t>(n);
  if (kind == StateKind::kMaster32)
    return optim::MasterBytes(bf16_master ? optim::MasterFormat::kBf16Nearest : optim::MasterFormat::kFp32, u);
  if (kind == StateKind::kExpAvg || kind == StateKind::kExpAvgSq) return optim::MomentBytes(moments, u);
  return 0;
}

namespace {

// An 8-bit state buffer of n elements: codes, then one scale per block.
void DecodeInt8(const void* block, int64_t n, bool is_signed, float* out) {
  const auto* codes = static_cast<const uint8_t*>(block);
  const auto* scales = reinterpret_cast<const float*>(codes + optim::Int8ScaleOffset(n));
  for (int64_t b = 0; b < n; b += optim::kInt8Block) {
    const size_t len = std::min<size_t>(optim::kInt8Block, n - b);
    optim::DequantizeBlock(codes + b, scales[b / optim::kInt8Block], len, is_signed, out + b);
  }
}

void EncodeInt8(const float* x, int64_t n, bool is_signed, void* block) {
  auto* codes = static_cast<uint8_t*>(block);
  auto* scales = reinterpret_cast<float*>(codes + optim::Int8ScaleOffset(n));
  std::memset(codes + n, 0, optim::Int8ScaleOffset(n) - n);  // the padding before the scales
  for (int64_t b = 0; b < n; b += optim::kInt8Block) {
    const size_t len = std::min<size_t>(optim::kInt8Block, n - b);
    optim::QuantizeBlock(x + b, len, is_signed, codes + b, &scales[b / optim::kInt8Block]);
  }
}

}  // namespace

void StateLayout::Decode(StateKind kind, const void* block, int64_t n, float* out) const {
  const bool bf16 = kind == StateKind::kMaster32 ? bf16_master : moments == optim::MomentFormat::kBf16;
  if (kind != StateKind::kMaster32 && moments == optim::MomentFormat::kInt8) {
    DecodeInt8(block, n, kind == StateKind::kExpAvg, out);
  } else if (bf16) {
    const auto* h = static_cast<const uint16_t*>(block);
    for (int64_t i = 0; i < n; ++i) out[i] = optim::Bf16ToFloat(h[i]);
  } else {
    std::memcpy(out, block, static_cast<size_t>(n) * sizeof(float));
  }
}

void StateLayout::Encode(StateKind kind, const float* values, int64_t n, void* block) const {
  const bool bf16 = kind == StateKind::kMaster32 ? bf16_master : moments == optim::MomentFormat::kBf16;
  if (kind != StateKind::kMaster32 && moments == optim::MomentFormat::kInt8) {
    EncodeInt8(values, n, kind == StateKind::kExpAvg, block);
  } else if (bf16) {
    auto* h = static_cast<uint16_t*>(block);
    for (int64_t i = 0; i < n; ++i) h[i] = optim::FloatToBf16(values[i]);
  } else {
    std::memcpy(block, values, static_cast<size_t>(n) * sizeof(float));
  }
}

}  // namespace strata
