#include "runtime/base/status.h"

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <ostream>

namespace strata {

std::string_view StatusCodeName(StatusCode code) {
  switch (code) {
    case StatusCode::kOk: return "OK";
    case StatusCode::kInvalidArgument: return "INVALID_ARGUMENT";
    case StatusCode::kNotFound: return "NOT_FOUND";
    case StatusCode::kAlreadyExists: return "ALREADY_EXISTS";
    case StatusCode::kPermissionDenied: return "PERMISSION_DENIED";
    case StatusCode::kResourceExhausted: return "RESOURCE_EXHAUSTED";
    case StatusCode::kFailedPrecondition: return "FAILED_PRECONDITION";
    case StatusCode::kOutOfRange: return "OUT_OF_RANGE";
    case StatusCode::kUnavailable: return "UNAVAILABLE";
    case StatusCode::kDeadlineExceeded: return "DEADLINE_EXCEEDED";
    case StatusCode::kDataLoss: return "DATA_LOSS";
    case StatusCode::kIoError: return "IO_ERROR";
    case StatusCode::kUnimplemented: return "UNIMPLEMENTED";
    case StatusCode::kCancelled: return "CANCELLED";
    case StatusCode::kInternal: return "INTERNAL";
  }
  return "UNKNOWN";
}

std::string Status::ToString() const {
  if (ok()) return "OK";
  return StrCat(StatusCodeName(code_), ": ", message_);
}

Status Status::WithContext(std::string_view context) const {
  if (ok()) return *this;
  return Status(code_, StrCat(context, ": ", message_), errno_);
}

std::ostream& operator<<(std::ostream& os, const Status& s) { return os << s.ToString(); }

Status ErrnoToStatus(int err, std::string_view context) {
  std::string msg = StrCat(context, ": ", std::strerror(err));
  StatusCode code = StatusCode::kIoError;
  switch (err) {
    case ENOENT:
      code = StatusCode::kNotFound;
      break;
    case EEXIST:
      code = StatusCode::kAlreadyExists;
      break;
    case EACCES:
    case EPERM:
      code = StatusCode::kPermissionDenied;
      msg += " (check the owner and mode of the path, or choose a directory you can write)";
      break;
    case EROFS:
      code = StatusCode::kPermissionDenied;
      msg += " (the filesystem is read-only; choose a writable directory)";
      break;
    case ENOSPC:
    case EDQUOT:
      code = StatusCode::kResourceExhausted;
      msg += " (free space on that filesystem or point the path at a larger one)";
      break;
    case ENOMEM:
      code = StatusCode::kResourceExhausted;
      break;
    case EAGAIN:
    case EBUSY:
      code = StatusCode::kUnavailable;
      break;
    case EINVAL:
    case ENOTDIR:
    case EISDIR:
    case ENAMETOOLONG:
      code = StatusCode::kInvalidArgument;
      break;
    case ETIMEDOUT:
      code = StatusCode::kDeadlineExceeded;
      break;
    case ECANCELED:
    case EINTR:
      code = StatusCode::kCancelled;
      break;
    case EOPNOTSUPP:
    case ENOSYS:
      code = StatusCode::kUnimplemented;
      break;
    case EIO:
    default:
      code = StatusCode::kIoError;
      break;
  }
  return Status(code, std::move(msg), err);
}

void DieWithStatus(const Status& s, const char* file, int line) {
  std::fprintf(stderr, "strata: fatal at %s:%d: %s\n", file, line, s.ToString().c_str());
  std::fflush(stderr);
  std::abort();
}

}  // namespace strata
