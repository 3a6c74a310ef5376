// The two assertion families, and why they differ.
//
// STRATA_CHECK(cond, msg...) is for conditions a user can violate (a config value, a flag, a file):
// when `cond` is false it returns an INVALID_ARGUMENT Status carrying the message from the
// enclosing function, which must return Status or StatusOr. The message should name the value and
// the fix. It never aborts: bad input is an error to report, not a crash.
//
// STRATA_DCHECK(cond, msg...) is for internal invariants that only a bug can break. It aborts with
// file and line in every build type: a broken invariant in a tier manager corrupts data later,
// so continuing is worse than stopping. Keep DCHECKs cheap; they stay on in release builds.
#pragma once

#include "runtime/base/status.h"

#define STRATA_CHECK(cond, ...)                                             \
  do {                                                                      \
    if (!(cond)) return ::strata::InvalidArgument(::strata::StrCat(__VA_ARGS__)); \
  } while (0)

#define STRATA_DCHECK(cond, ...)                                                   \
  do {                                                                             \
    if (!(cond))                                                                   \
      ::strata::DieWithStatus(                                                     \
          ::strata::Internal(::strata::StrCat("invariant failed: " #cond ". ", ##__VA_ARGS__)), \
          __FILE__, __LINE__);                                                     \
  } while (0)

// Aborts on a non-OK status; for tools' main() and tests where nothing can recover.
#define STRATA_CHECK_OK(expr)                                                      \
  do {                                                                             \
    ::strata::Status strata_s_ = (expr);                                           \
    if (!strata_s_.ok()) ::strata::DieWithStatus(strata_s_, __FILE__, __LINE__);   \
  } while (0)
