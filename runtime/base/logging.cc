#include "runtime/base/logging.h"
#include "runtime/base/env_vars.h"

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>

namespace strata {
namespace {

LogLevel LevelFromEnv() {
  LogLevel level = LogLevel::kInfo;
  if (const char* env = GetEnv(kEnvLogLevel)) {
    if (!ParseLogLevel(env, &level)) {
      std::fprintf(stderr,
                   "strata: STRATA_LOG_LEVEL=%s is not a level; use debug, info, warn, error or "
                   "off (using info)\n",
                   env);
      level = LogLevel::kInfo;
    }
  }
  return level;
}

std::atomic<int>& LevelStorage() {
  static std::atomic<int> level{static_cast<int>(LevelFromEnv())};
  return level;
}

const char* Basename(const char* path) {
  const char* slash = std::strrchr(path, '/');
  return slash ? slash + 1 : path;
}

}  // namespace

LogLevel GetLogLevel() { return static_cast<LogLevel>(LevelStorage().load(std::memory_order_relaxed)); }
void SetLogLevel(LogLevel level) { LevelStorage().store(static_cast<int>(level)); }

bool ParseLogLevel(std::string_view t, LogLevel* out) {
  if (t == "debug") *out = LogLevel::kDebug;
  else if (t == "info") *out = LogLevel::kInfo;
  else if (t == "warn" || t == "warning") *out = LogLevel::kWarn;
  else if (t == "error") *out = LogLevel::kError;
  else if (t == "off") *out = LogLevel::kOff;
  else return false;
  return true;
}

LogMessage::LogMessage(LogLevel level, const char* file, int line) : level_(level) {
  static constexpr char kTag[] = {'D', 'I', 'W', 'E'};
  auto now = std::chrono::system_clock::now();
  std::time_t secs = std::chrono::system_clock::to_time_t(now);
  int ms = static_cast<int>(
      std::chrono::duration_cast<std::chrono::milliseconds>(now.time_since_epoch()).count() % 1000);
  std::tm tm{};
  localtime_r(&secs, &tm);
  char buf[32];
  std::snprintf(buf, sizeof buf, "%02d:%02d:%02d.%03d", tm.tm_hour, tm.tm_min, tm.tm_sec, ms);
  stream_ << "[strata " << kTag[static_cast<int>(level)] << ' ' << buf << ' ' << Basename(file)
          << ':' << line << "] ";
}

LogMessage::~LogMessage() {
  stream_ << '\n';
  std::string s = stream_.str();
  std::fwrite(s.data(), 1, s.size(), stderr);
  if (level_ >= LogLevel::kWarn) std::fflush(stderr);
}

}  // namespace strata
