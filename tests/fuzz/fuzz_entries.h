// The untrusted-input readers as fuzz entry points, shared by the libFuzzer targets
// (built with -DSTRATA_FUZZ=ON and clang) and by fuzz_corpus_replay_test (always built, g++ too).
//
// Each entry parses `bytes` and checks what must hold for any input:
// - a rejection is a non-OK Status with a non-empty message (never an exception, never a crash);
// - an accepted input serializes back to bytes that parse again to the same value (round trip).
// The parse Status is returned; a broken property is described in *bug (left empty otherwise).
// The libFuzzer wrappers abort on a bug so the fuzzer saves the input.
#pragma once

#include <exception>
#include <string>
#include <string_view>

#include "runtime/base/config.h"
#include "runtime/base/status.h"
#include "runtime/state/checkpoint.h"
#include "tiers/nvme/swap_index.h"
#include "tools/planner/cost_model.h"
#include "tools/planner/profile.h"

namespace strata::fuzz {

namespace internal {
inline void CheckRejection(const Status& s, std::string* bug) {
  if (!s.ok() && s.message().empty()) *bug = "rejected with an empty message: " + s.ToString();
}
}  // namespace internal

inline Status FuzzConfig(std::string_view bytes, std::string* bug) {
  bug->clear();
  try {
    auto c = Config::FromJsonText(std::string(bytes), "<fuzz>");
    if (!c.ok()) {
      internal::CheckRejection(c.status(), bug);
      return c.status();
    }
    // The effective config (every default filled in) must be accepted and mean the same.
    auto again = Config::FromJsonText(c->ToJsonString(), "<fuzz:round-trip>");
    if (!again.ok()) {
      *bug = "the effective config of an accepted input is rejected: " + again.status().ToString();
    } else if (!(*again == *c)) {
      *bug = "the effective config of an accepted input parses to a different config";
    }
    return Status();
  } catch (const std::exception& e) {
    *bug = std::string("exception escaped Config::FromJsonText: ") + e.what();
    return Internal(*bug);
  }
}

inline Status FuzzSwapIndex(std::string_view bytes, std::string* bug) {
  bug->clear();
  try {
    auto idx = nvme::ParseSwapIndex(bytes, "<fuzz>");
    if (!idx.ok()) {
      internal::CheckRejection(idx.status(), bug);
      return idx.status();
    }
    auto again = nvme::ParseSwapIndex(nvme::SerializeSwapIndex(*idx), "<fuzz:round-trip>");
    if (!again.ok()) {
      *bug = "a parsed index serializes to bytes that do not parse: " + again.status().ToString();
    } else if (again->blocks.size() != idx->blocks.size() || again->files != idx->files ||
               again->capacity != idx->capacity) {
      *bug = "a parsed index does not survive a serialize/parse round trip";
    }
    return Status();
  } catch (const std::exception& e) {
    *bug = std::string("exception escaped ParseSwapIndex: ") + e.what();
    return Internal(*bug);
  }
}

inline Status FuzzManifest(std::string_view bytes, std::string* bug) {
  bug->clear();
  try {
    auto m = checkpoint::ParseManifest(bytes, "<fuzz>");
    if (!m.ok()) {
      internal::CheckRejection(m.status(), bug);
      return m.status();
    }
    auto again = checkpoint::ParseManifest(checkpoint::SerializeManifest(*m), "<fuzz:round-trip>");
    if (!again.ok()) {
      *bug = "a parsed manifest serializes to bytes that do not parse: " + again.status().ToString();
    } else if (again->blocks.size() != m->blocks.size() || again->shard_numel != m->shard_numel ||
               again->global_step != m->global_step ||
               again->gradient_accumulation_steps != m->gradient_accumulation_steps ||
               again->scaler != m->scaler || again->buffers.size() != m->buffers.size() ||
               again->frozen.size() != m->frozen.size()) {
      *bug = "a parsed manifest does not survive a serialize/parse round trip";
    }
    return Status();
  } catch (const std::exception& e) {
    *bug = std::string("exception escaped ParseManifest: ") + e.what();
    return Internal(*bug);
  }
}

// The hardware profile strata-tune and strata-estimate read (--profile): besides the parse, the
// readers of an accepted profile (the rates for either device, the recommended aio setting) must
// answer with a value or a Status.
inline Status FuzzProfile(std::string_view bytes, std::string* bug) {
  bug->clear();
  try {
    auto h = planner::HardwareProfile::FromJsonText(bytes, "<fuzz>");
    if (!h.ok()) {
      internal::CheckRejection(h.status(), bug);
      return h.status();
    }
    for (const char* device : {"cpu", "cuda"}) {
      auto r = planner::RatesFromProfile(*h, device, 0);
      if (!r.ok()) internal::CheckRejection(r.status(), bug);
    }
    auto best = h->BestAio();
    if (!best.ok()) internal::CheckRejection(best.status(), bug);
    auto again = planner::HardwareProfile::FromJsonText(h->ToJson().dump(), "<fuzz:round-trip>");
    if (!again.ok()) {
      *bug = "an accepted profile writes JSON that does not read back: " + again.status().ToString();
    } else if (again->nvme.size() != h->nvme.size() || again->copies.size() != h->copies.size() ||
               again->dram_gbps != h->dram_gbps || again->adam_gelems_per_s != h->adam_gelems_per_s ||
               again->compute_gflops != h->compute_gflops ||
               again->device_capacity_bytes != h->device_capacity_bytes ||
               (h->compute_gflops > 0 && again->compute_device != h->compute_device)) {
      *bug = "an accepted profile does not survive a write/read round trip";
    }
    return Status();
  } catch (const std::exception& e) {
    *bug = std::string("exception escaped HardwareProfile::FromJsonText: ") + e.what();
    return Internal(*bug);
  }
}

}  // namespace strata::fuzz
