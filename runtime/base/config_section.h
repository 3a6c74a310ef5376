// config_section.h: one JSON object of a config file, read key by key (internal to the config
// parser: config.cc and config_keys.h include it; nothing else should).
//
// Contract: every accessor leaves the field unchanged when the key is absent or null, records the
// key as known, and returns InvalidArgument naming the dotted key, the value given and what is
// allowed. Finish() then names any key of the object nobody asked for.
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "runtime/base/status.h"
#include "runtime/base/units.h"

namespace strata::config_internal {

using json = nlohmann::json;

inline size_t EditDistance(const std::string& a, const std::string& b) {
  std::vector<size_t> prev(b.size() + 1), cur(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) prev[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    cur[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      size_t sub = prev[j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1);
      cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, sub});
    }
    std::swap(prev, cur);
  }
  return prev[b.size()];
}

inline std::string Describe(const json& v) {
  std::string s = v.dump();
  if (s.size() > 60) s = s.substr(0, 57) + "...";
  return s;
}

// Reads one JSON object section, recording which keys were consumed so that Finish() can name
// any key nobody asked for. Every accessor leaves the default in place when the key is absent.
// Note [strict keys]: DeepSpeed silently ignores keys it does not know, so a typo such as
// "stage3_prefech_bucket_size" runs with the default and nobody notices. Strata refuses them.
class Section {
 public:
  Section(const json* obj, std::string path, std::vector<std::string>* warnings,
          std::vector<std::string>* autos)
      : obj_(obj), path_(std::move(path)), warnings_(warnings), autos_(autos) {}

  bool has(const std::string& key) const { return obj_ && obj_->contains(key); }

  std::string Key(const std::string& key) const { return path_.empty() ? key : path_ + "." + key; }

  void Warn(const std::string& msg) { warnings_->push_back(msg); }

  const json* Get(const std::string& key) {
    known_.insert(key);
    if (!obj_) return nullptr;
    auto it = obj_->find(key);
    if (it == obj_->end() || it->is_null()) return nullptr;
    return &*it;
  }

  // Keys DeepSpeed accepts that have no effect here: allowed, with a warning.
  void Ignored(const std::string& key, const char* why) {
    if (Get(key)) Warn(StrCat(Key(key), " is accepted for DeepSpeed compatibility but ", why));
  }

  // Note [auto values]: Hugging Face's DeepSpeed integration writes "auto" for values it fills
  // in from the trainer's arguments. Strata records the key (Config::auto_keys), leaves the
  // default in place, and Config::ResolveAuto fills it from the run. Accessors call this first.
  bool IsAuto(const std::string& key) {
    const json* v = Get(key);
    if (!v || !v->is_string() || v->get<std::string>() != "auto") return false;
    autos_->push_back(Key(key));
    return true;
  }

  // An old spelling: read as `now` (which must not also be present).
  Status Alias(const std::string& old_key, const std::string& now_key) {
    known_.insert(old_key);
    if (!obj_ || !obj_->contains(old_key)) return Status::Ok();
    if (obj_->contains(now_key)) {
      return InvalidArgument(StrCat(Key(old_key), " and ", Key(now_key),
                                    " are both set; remove the deprecated ", Key(old_key)));
    }
    Warn(StrCat(Key(old_key), " is deprecated; use ", Key(now_key), " (value taken)"));
    aliases_[now_key] = old_key;
    return Status::Ok();
  }

  Status Bool(const std::string& key, bool* out) {
    if (IsAuto(key)) return Status::Ok();
    const json* v = Lookup(key);
    if (!v) return Status::Ok();
    if (v->is_boolean()) {
      *out = v->get<bool>();
      return Status::Ok();
    }
    if (v->is_string()) {
      std::string s = v->get<std::string>();
      std::string lower = s;
      std::transform(lower.begin(), lower.end(), lower.begin(), ::tolower);
      if (lower == "true" || lower == "false") {
        Warn(StrCat(Name(key), "=\"", s, "\" is a string; write the JSON boolean ", lower));
        *out = lower == "true";
        return Status::Ok();
      }
    }
    return InvalidArgument(StrCat(Name(key), "=", Describe(*v), ": must be true or false"));
  }

  Status Int(const std::string& key, int64_t* out, int64_t lo, int64_t hi) {
    if (IsAuto(key)) return Status::Ok();
    const json* v = Lookup(key);
    if (!v) return Status::Ok();
    double d;
    if (v->is_number_integer()) {
      if (v->is_number_unsigned() && v->get<uint64_t>() > uint64_t(std::numeric_limits<int64_t>::max()))
        return Range(key, *v, lo, hi);
      *out = v->get<int64_t>();
    } else if (v->is_number_float()) {  // 5e8 parses as a float in JSON
      d = v->get<double>();
      if (!std::isfinite(d) || d != std::floor(d) || std::fabs(d) > 9.2e18)
        return InvalidArgument(StrCat(Name(key), "=", Describe(*v), ": must be a whole number in ",
                                      lo, "..", hi));
      *out = static_cast<int64_t>(d);
    } else {
      return InvalidArgument(StrCat(Name(key), "=", Describe(*v), ": must be a whole number in ", lo,
                                    "..", hi));
    }
    if (*out < lo || *out > hi) return Range(key, *v, lo, hi);
    return Status::Ok();
  }

  Status Double(const std::string& key, double* out, double lo, double hi, bool hi_open = false,
                bool lo_open = false) {
    if (IsAuto(key)) return Status::Ok();
    const json* v = Lookup(key);
    if (!v) return Status::Ok();
    if (!v->is_number())
      return InvalidArgument(StrCat(Name(key), "=", Describe(*v), ": must be a number in ",
                                    lo_open ? "(" : "[", lo, ", ", hi, hi_open ? ")" : "]"));
    double d = v->get<double>();
    bool ok = std::isfinite(d) && (lo_open ? d > lo : d >= lo) && (hi_open ? d < hi : d <= hi);
    if (!ok)
      return InvalidArgument(StrCat(Name(key), "=", Describe(*v), ": must be in ",
                                    lo_open ? "(" : "[", lo, ", ", hi, hi_open ? ")" : "]"));
    *out = d;
    return Status::Ok();
  }

  // A byte count: a whole number, 5e8, or a string such as "24GiB".
  Status Bytes(const std::string& key, uint64_t* out, uint64_t lo, uint64_t hi) {
    if (IsAuto(key)) return Status::Ok();
    const json* v = Lookup(key);
    if (!v) return Status::Ok();
    uint64_t b = 0;
    if (v->is_string()) {
      auto parsed = ParseBytes(v->get<std::string>());
      if (!parsed.ok()) return InvalidArgument(StrCat(Name(key), ": ", parsed.status().message()));
      b = *parsed;
    } else if (v->is_number_unsigned() || (v->is_number_integer() && v->get<int64_t>() >= 0)) {
      b = v->get<uint64_t>();
    } else if (v->is_number_float() && std::isfinite(v->get<double>()) && v->get<double>() >= 0 &&
               v->get<double>() == std::floor(v->get<double>()) && v->get<double>() < 1.8e19) {
      b = static_cast<uint64_t>(v->get<double>());
    } else {
      return InvalidArgument(StrCat(Name(key), "=", Describe(*v),
                                    ": must be a byte count such as 1073741824, 1e9 or \"1GiB\""));
    }
    if (b < lo || b > hi)
      return InvalidArgument(StrCat(Name(key), "=", Describe(*v), ": must be between ",
                                    FormatBytes(lo), " and ", FormatBytes(hi)));
    *out = b;
    return Status::Ok();
  }

  Status String(const std::string& key, std::string* out) {
    const json* v = Lookup(key);
    if (!v) return Status::Ok();
    if (!v->is_string())
      return InvalidArgument(StrCat(Name(key), "=", Describe(*v), ": must be a string"));
    *out = v->get<std::string>();
    return Status::Ok();
  }

  // A string or a list of strings.
  Status StringList(const std::string& key, std::vector<std::string>* out) {
    const json* v = Lookup(key);
    if (!v) return Status::Ok();
    std::vector<std::string> r;
    if (v->is_string()) {
      r.push_back(v->get<std::string>());
    } else if (v->is_array()) {
      for (const auto& e : *v) {
        if (!e.is_string())
          return InvalidArgument(StrCat(Name(key), "=", Describe(*v), ": must be a string or a list of strings"));
        r.push_back(e.get<std::string>());
      }
    } else {
      return InvalidArgument(StrCat(Name(key), "=", Describe(*v), ": must be a string or a list of strings"));
    }
    for (const auto& s : r)
      if (s.empty()) return InvalidArgument(StrCat(Name(key), ": an empty path is not allowed"));
    *out = std::move(r);
    return Status::Ok();
  }

  // A case-insensitive choice among named values.
  template <typename E>
  Status Enum(const std::string& key, E* out, const std::vector<std::pair<std::string, E>>& choices) {
    const json* v = Lookup(key);
    if (!v) return Status::Ok();
    std::string names;
    for (const auto& c : choices) names += (names.empty() ? "" : ", ") + c.first;
    if (!v->is_string())
      return InvalidArgument(StrCat(Name(key), "=", Describe(*v), ": must be one of ", names));
    std::string s = v->get<std::string>();
    std::string lower = s;
    std::transform(lower.begin(), lower.end(), lower.begin(), ::tolower);
    for (const auto& c : choices) {
      std::string cl = c.first;
      std::transform(cl.begin(), cl.end(), cl.begin(), ::tolower);
      if (cl == lower) {
        *out = c.second;
        return Status::Ok();
      }
    }
    return InvalidArgument(StrCat(Name(key), "=\"", s, "\": must be one of ", names));
  }

  // A nested object (absent → an empty section so defaults stay).
  StatusOr<Section> Child(const std::string& key) {
    const json* v = Get(key);
    if (v && !v->is_object())
      return InvalidArgument(StrCat(Key(key), "=", Describe(*v), ": must be a JSON object"));
    return Section(v, Key(key), warnings_, autos_);
  }

  // Errors on the first key nobody consumed, suggesting the closest known spelling. With
  // warn_only (the top level, where DeepSpeed ignores unknown keys) each such key is a warning.
  Status Finish(bool warn_only = false) {
    if (!obj_) return Status::Ok();
    for (auto it = obj_->begin(); it != obj_->end(); ++it) {
      if (known_.count(it.key())) continue;
      std::string best;
      size_t best_d = std::numeric_limits<size_t>::max();
      for (const auto& k : known_) {
        size_t d = EditDistance(it.key(), k);
        // A truncated or extended spelling ("train_micro_batch_size") is closer than its raw
        // edit distance says.
        if (k.find(it.key()) != std::string::npos || it.key().find(k) != std::string::npos)
          d = std::min(d, 1 + (std::max(k.size(), it.key().size()) -
                               std::min(k.size(), it.key().size())) / 4);
        if (d < best_d) best_d = d, best = k;
      }
      std::string msg = StrCat("unknown key ", Key(it.key()));
      // Close: a few edits, and fewer than half the longer spelling's letters ("foo" is not a
      // misspelled "aio").
      const bool close = !best.empty() && best_d <= std::max<size_t>(3, it.key().size() / 3) &&
                         2 * best_d < std::max(it.key().size(), best.size());
      if (warn_only) {
        Warn(StrCat(msg, " is ignored (DeepSpeed ignores it too)",
                    close ? StrCat("; did you mean ", Key(best), "?") : std::string()));
        continue;
      }
      if (close)
        msg += StrCat("; did you mean ", Key(best), "?");
      else if (!known_.empty()) {
        std::string all;
        for (const auto& k : known_) all += (all.empty() ? "" : ", ") + k;
        msg += StrCat("; valid keys here: ", all);
      }
      return InvalidArgument(msg);
    }
    return Status::Ok();
  }

 private:
  // The value for `key`, or for its deprecated alias.
  const json* Lookup(const std::string& key) {
    const json* v = Get(key);
    if (v) return v;
    auto a = aliases_.find(key);
    if (a != aliases_.end()) return Get(a->second);
    return nullptr;
  }
  std::string Name(const std::string& key) const {
    auto a = aliases_.find(key);
    if (a != aliases_.end() && obj_ && obj_->contains(a->second)) return Key(a->second);
    return Key(key);
  }
  Status Range(const std::string& key, const json& v, int64_t lo, int64_t hi) const {
    return InvalidArgument(StrCat(Name(key), "=", Describe(v), ": must be in ", lo, "..", hi));
  }

  const json* obj_;
  std::string path_;
  std::vector<std::string>* warnings_;
  std::vector<std::string>* autos_;
  std::set<std::string> known_;
  std::map<std::string, std::string> aliases_;
};

}  // namespace strata::config_internal
