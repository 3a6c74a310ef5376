// config_keys.h: a config section's keys as one table, read by the parser and written by
// Config::ToJson (internal to config.cc).
//
// Note [one table of keys]: a section's keys used to be listed twice, once in its Parse function
// and once in ToJson, kept in step by hand. Now each key is one ConfigKey: its name, how it is
// read (type, range, check) and how it is written back. A key that is read is therefore written,
// under the same name and in the same form, and ToJson's output parses to an equal Config.
//
// What stays outside the tables, in the Parse functions, because it is not one field: deprecated
// spellings (read only; ToJson writes the current name), checks across keys, sections whose keys
// depend on a type (the optimizer's and the scheduler's params pick a table by type), and
// warnings for values that have no effect.
#pragma once

#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "runtime/base/config_section.h"

namespace strata::config_internal {

template <typename C>
struct ConfigKey {
  const char* name;
  std::function<Status(Section&, C*)> read;
  // Writes the key's effective value into the section's JSON. Empty for keys accepted without
  // effect (IgnoredKey): they are not part of the effective config.
  std::function<void(const C&, json*)> write;
};

template <typename C>
using KeyTable = std::vector<ConfigKey<C>>;

// Reads every key of `keys` from `s` in table order; the first error wins.
template <typename C>
Status ReadKeys(Section& s, const KeyTable<C>& keys, C* c) {
  for (const auto& k : keys) STRATA_RETURN_IF_ERROR(k.read(s, c));
  return Status::Ok();
}

// The section's effective JSON: every key of `keys` that has a value.
template <typename C>
json WriteKeys(const KeyTable<C>& keys, const C& c) {
  json j = json::object();
  for (const auto& k : keys)
    if (k.write) k.write(c, &j);
  return j;
}

// A check run after the key is read, on the value read (e.g. an O_DIRECT alignment).
// `check` is called as check(const Section&, const C&) -> Status.
template <typename C, typename Check>
ConfigKey<C> Checked(ConfigKey<C> key, Check check) {
  auto read = key.read;
  key.read = [read, check](Section& s, C* c) -> Status {
    STRATA_RETURN_IF_ERROR(read(s, c));
    return check(s, *c);
  };
  return key;
}

template <typename C>
ConfigKey<C> BoolKey(const char* name, bool C::*m) {
  return {name, [=](Section& s, C* c) { return s.Bool(name, &(c->*m)); },
          [=](const C& c, json* j) { (*j)[name] = c.*m; }};
}

// A whole number in [lo, hi], held in any integer field (int for zero_optimization.stage).
template <typename C, typename T>
ConfigKey<C> IntKey(const char* name, T C::*m, int64_t lo, int64_t hi) {
  return {name,
          [=](Section& s, C* c) -> Status {
            int64_t v = static_cast<int64_t>(c->*m);
            STRATA_RETURN_IF_ERROR(s.Int(name, &v, lo, hi));
            c->*m = static_cast<T>(v);
            return Status::Ok();
          },
          [=](const C& c, json* j) { (*j)[name] = c.*m; }};
}

// A whole number in [lo, hi] whose field holds -1 while the key is absent (DeepSpeed's default
// would act where Strata's absence does not); written back only when set.
template <typename C>
ConfigKey<C> OptionalIntKey(const char* name, int64_t C::*m, int64_t lo, int64_t hi) {
  ConfigKey<C> key = IntKey(name, m, lo, hi);
  key.write = [=](const C& c, json* j) {
    if (c.*m >= 0) (*j)[name] = c.*m;
  };
  return key;
}

template <typename C>
ConfigKey<C> DoubleKey(const char* name, double C::*m, double lo, double hi, bool hi_open = false,
                       bool lo_open = false) {
  return {name, [=](Section& s, C* c) { return s.Double(name, &(c->*m), lo, hi, hi_open, lo_open); },
          [=](const C& c, json* j) { (*j)[name] = c.*m; }};
}

// A byte count (a number, 5e8 or "24GiB"); written back as a number of bytes.
template <typename C>
ConfigKey<C> BytesKey(const char* name, uint64_t C::*m, uint64_t lo, uint64_t hi) {
  return {name, [=](Section& s, C* c) { return s.Bytes(name, &(c->*m), lo, hi); },
          [=](const C& c, json* j) { (*j)[name] = c.*m; }};
}

template <typename C>
ConfigKey<C> StringListKey(const char* name, std::vector<std::string> C::*m) {
  return {name, [=](Section& s, C* c) { return s.StringList(name, &(c->*m)); },
          [=](const C& c, json* j) { (*j)[name] = c.*m; }};
}

// One of named values, case-insensitive; written back under the table's spelling.
template <typename C, typename E>
ConfigKey<C> EnumKey(const char* name, E C::*m, std::vector<std::pair<std::string, E>> choices) {
  return {name, [=](Section& s, C* c) { return s.Enum(name, &(c->*m), choices); },
          [=](const C& c, json* j) {
            for (const auto& choice : choices)
              if (choice.second == c.*m) (*j)[name] = choice.first;
          }};
}

// A string that must be one of `choices`, exactly as written (kept as a string in the struct).
template <typename C>
ConfigKey<C> ChoiceKey(const char* name, std::string C::*m, std::vector<std::string> choices) {
  return {name,
          [=](Section& s, C* c) -> Status {
            std::string v = c->*m;
            STRATA_RETURN_IF_ERROR(s.String(name, &v));
            if (std::find(choices.begin(), choices.end(), v) == choices.end()) {
              std::string all;
              for (const auto& x : choices) all += (all.empty() ? "" : ", ") + x;
              return InvalidArgument(StrCat(s.Key(name), "=\"", v, "\": must be one of ", all));
            }
            c->*m = v;
            return Status::Ok();
          },
          [=](const C& c, json* j) { (*j)[name] = c.*m; }};
}

// A key DeepSpeed knows that has no effect here: accepted, with one warning saying `why`.
template <typename C>
ConfigKey<C> IgnoredKey(const char* name, const char* why) {
  return {name, [=](Section& s, C*) {
            s.Ignored(name, why);
            return Status::Ok();
          },
          nullptr};
}

}  // namespace strata::config_internal
