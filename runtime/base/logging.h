// Leveled logging to stderr.
//
// The level comes from STRATA_LOG_LEVEL (debug, info, warn, error; default info) and can be
// changed with SetLogLevel. Figures are written as key=value so logs can be grepped and parsed:
//   STRATA_LOG(INFO) << "nvme engine=" << name << " gbps=" << g;
// STRATA_LOG_ONCE logs a message the first time its line runs (fallback notices, deprecations).
// Thread-safe: each message is formatted privately and written with one call.
#pragma once

#include <atomic>
#include <sstream>
#include <string_view>

namespace strata {

enum class LogLevel : int { kDebug = 0, kInfo = 1, kWarn = 2, kError = 3, kOff = 4 };

LogLevel GetLogLevel();
void SetLogLevel(LogLevel level);
// Parses "debug" / "info" / "warn" / "warning" / "error" / "off"; false on anything else.
bool ParseLogLevel(std::string_view text, LogLevel* out);

class LogMessage {
 public:
  LogMessage(LogLevel level, const char* file, int line);
  ~LogMessage();
  std::ostringstream& stream() { return stream_; }

 private:
  LogLevel level_;
  std::ostringstream stream_;
};

// Lets `cond ? (void)0 : Voidify() & stream` compile as a statement.
struct LogVoidify {
  void operator&(std::ostream&) {}
};

}  // namespace strata

#define STRATA_LOG_LEVEL_DEBUG ::strata::LogLevel::kDebug
#define STRATA_LOG_LEVEL_INFO ::strata::LogLevel::kInfo
#define STRATA_LOG_LEVEL_WARN ::strata::LogLevel::kWarn
#define STRATA_LOG_LEVEL_ERROR ::strata::LogLevel::kError

#define STRATA_LOG(sev)                                                   \
  (STRATA_LOG_LEVEL_##sev < ::strata::GetLogLevel())                      \
      ? (void)0                                                           \
      : ::strata::LogVoidify() &                                          \
            ::strata::LogMessage(STRATA_LOG_LEVEL_##sev, __FILE__, __LINE__).stream()

#define STRATA_LOG_ONCE(sev)                                                         \
  for (static std::atomic<bool> strata_once_{false}; !strata_once_.exchange(true);) \
  STRATA_LOG(sev)
