// Status and StatusOr: how every fallible operation in Strata reports failure.
//
// Contract: functions that can fail at run time (I/O, allocation, configuration, communication)
// return Status or StatusOr<T>; they never throw. Exceptions appear only at the LibTorch
// boundary. A message names the thing that failed, the offending value and, where one exists,
// the fix: "aio.queue_depth=0: must be 1..4096".
#pragma once

#include <cstdlib>
#include <iosfwd>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>
#include <utility>

namespace strata {

enum class StatusCode : int {
  kOk = 0,
  kInvalidArgument,    // bad input from a user: config, flag, file contents
  kNotFound,           // ENOENT, missing key or block
  kAlreadyExists,      // EEXIST
  kPermissionDenied,   // EACCES, EPERM, EROFS
  kResourceExhausted,  // ENOSPC, ENOMEM, EDQUOT, a budget that cannot hold a request
  kFailedPrecondition, // the call is legal but the object is in the wrong state
  kOutOfRange,         // read past the end, short file
  kUnavailable,        // EAGAIN, a peer that cannot be reached yet
  kDeadlineExceeded,   // a timeout expired
  kDataLoss,           // checksum mismatch, corrupted or truncated data
  kIoError,            // EIO and other device errors
  kUnimplemented,      // a capability this build or device does not have
  kCancelled,          // work abandoned because of shutdown or an earlier failure
  kInternal,           // a bug: an invariant that should have held did not
};

std::string_view StatusCodeName(StatusCode code);

class [[nodiscard]] Status {
 public:
  Status() = default;  // OK
  Status(StatusCode code, std::string message, int sys_errno = 0)
      : code_(code), message_(std::move(message)), errno_(sys_errno) {}

  static Status Ok() { return Status(); }

  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }
  // The errno this status was built from, 0 when it did not come from a system call.
  int sys_errno() const { return errno_; }

  // "IO_ERROR: pwrite /nvme/strata/rank0.swap at 4096: Input/output error"
  std::string ToString() const;

  // Prepends context ("while swapping out block 12: ") keeping code and errno.
  Status WithContext(std::string_view context) const;

  // Explicitly discards a status whose failure the caller has decided not to act on
  // (cleanup paths that already report an earlier error).
  void IgnoreError() const {}

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
  int errno_ = 0;
};

std::ostream& operator<<(std::ostream& os, const Status& s);

// Maps an errno to a Status whose message is "<context>: <strerror>" plus, for the common
// storage errors, what the user can do about it.
Status ErrnoToStatus(int err, std::string_view context);

// Builds a string from streamable pieces: StrCat("block ", id, " at ", offset).
template <typename... Args>
std::string StrCat(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}

inline Status InvalidArgument(std::string msg) { return {StatusCode::kInvalidArgument, std::move(msg)}; }
inline Status NotFound(std::string msg) { return {StatusCode::kNotFound, std::move(msg)}; }
inline Status ResourceExhausted(std::string msg) { return {StatusCode::kResourceExhausted, std::move(msg)}; }
inline Status FailedPrecondition(std::string msg) { return {StatusCode::kFailedPrecondition, std::move(msg)}; }
inline Status OutOfRange(std::string msg) { return {StatusCode::kOutOfRange, std::move(msg)}; }
inline Status DataLoss(std::string msg) { return {StatusCode::kDataLoss, std::move(msg)}; }
inline Status IoError(std::string msg) { return {StatusCode::kIoError, std::move(msg)}; }
inline Status Unimplemented(std::string msg) { return {StatusCode::kUnimplemented, std::move(msg)}; }
inline Status Unavailable(std::string msg) { return {StatusCode::kUnavailable, std::move(msg)}; }
inline Status DeadlineExceeded(std::string msg) { return {StatusCode::kDeadlineExceeded, std::move(msg)}; }
inline Status Cancelled(std::string msg) { return {StatusCode::kCancelled, std::move(msg)}; }
inline Status Internal(std::string msg) { return {StatusCode::kInternal, std::move(msg)}; }

[[noreturn]] void DieWithStatus(const Status& s, const char* file, int line);

// A value or the Status explaining why there is none. Accessing value() of a non-OK StatusOr
// is a bug and aborts with the status message.
template <typename T>
class [[nodiscard]] StatusOr {
 public:
  StatusOr(const Status& s) : status_(s) {  // NOLINT: implicit by design
    if (status_.ok()) status_ = Internal("StatusOr constructed from an OK status without a value");
  }
  StatusOr(Status&& s) : status_(std::move(s)) {  // NOLINT
    if (status_.ok()) status_ = Internal("StatusOr constructed from an OK status without a value");
  }
  StatusOr(const T& v) : value_(v) {}        // NOLINT
  StatusOr(T&& v) : value_(std::move(v)) {}  // NOLINT

  bool ok() const { return status_.ok(); }
  const Status& status() const { return status_; }

  T& value() & {
    if (!ok()) DieWithStatus(status_, __FILE__, __LINE__);
    return *value_;
  }
  const T& value() const& {
    if (!ok()) DieWithStatus(status_, __FILE__, __LINE__);
    return *value_;
  }
  T&& value() && {
    if (!ok()) DieWithStatus(status_, __FILE__, __LINE__);
    return std::move(*value_);
  }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }

 private:
  Status status_;
  std::optional<T> value_;
};

}  // namespace strata

#define STRATA_STATUS_CONCAT_INNER(a, b) a##b
#define STRATA_STATUS_CONCAT(a, b) STRATA_STATUS_CONCAT_INNER(a, b)

// Returns the status from the enclosing function when `expr` is not OK.
#define STRATA_RETURN_IF_ERROR(expr)            \
  do {                                          \
    ::strata::Status strata_s_ = (expr);        \
    if (!strata_s_.ok()) return strata_s_;      \
  } while (0)

// `STRATA_ASSIGN_OR_RETURN(auto x, MakeX());` — binds the value or returns the error.
#define STRATA_ASSIGN_OR_RETURN(lhs, expr) \
  STRATA_ASSIGN_OR_RETURN_IMPL(STRATA_STATUS_CONCAT(strata_sor_, __LINE__), lhs, expr)
#define STRATA_ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                                 \
  if (!tmp.ok()) return tmp.status();                \
  lhs = std::move(tmp).value()
