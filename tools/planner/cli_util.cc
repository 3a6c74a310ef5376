#include "tools/planner/cli_util.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "runtime/base/host_info.h"
#include "runtime/base/relaxed_json.h"

namespace strata::planner {

int ParseArgs(CLI::App& app, int argc, char** argv) {
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::cerr << app.get_name() << ": " << e.what() << "\nRun `" << app.get_name()
              << " --help` for the options.\n";
    return 2;
  }
  // An empty value (--hbm '') would read as "not given" and the run go on with the default.
  for (const CLI::Option* o : app.get_options()) {
    if (o->count() == 0 || o->get_type_size() == 0) continue;  // not given, or a flag
    for (const std::string& v : o->results()) {
      if (!v.empty()) continue;
      std::cerr << app.get_name() << ": " << o->get_name()
                << "='': needs a value (leave the flag out for "
                << "the default)\nRun `" << app.get_name() << " --help` for the options.\n";
      return 2;
    }
  }
  return -1;
}

StatusOr<int64_t> ParseCount(const std::string& flag, const std::string& text, int64_t lo, int64_t hi) {
  char* end = nullptr;
  errno = 0;
  const double v = std::strtod(text.c_str(), &end);
  if (text.empty() || errno != 0 || *end != '\0' || !std::isfinite(v) || v != std::floor(v) ||
      v < static_cast<double>(lo) || v > static_cast<double>(hi))
    return InvalidArgument(StrCat(flag, "=", text, ": must be a whole number in ", lo, "..", hi,
                                  hi >= 1500000000 ? " (e.g. 1.5e9)" : ""));
  return static_cast<int64_t>(v);
}

Status ResolveAutoForPlanning(Config* config, const std::string& device, int world_size) {
  AutoContext ctx;
  ctx.world_size = world_size;
  ctx.hidden_size = config->model.d_model;
  ctx.native_bf16 = device.rfind("cuda", 0) == 0 || CpuHasNativeBf16();
  return config->ResolveAuto(ctx);
}

StatusOr<double> ParseGflops(const std::string& text) {
  char* end = nullptr;
  const double v = std::strtod(text.c_str(), &end);
  // From a thousandth of a GFLOP/s (far below any core) to 10^7 (far above any machine): outside
  // that, a typo, and step times hundreds of digits wide.
  if (text.empty() || *end != '\0' || !(v >= 1e-3) || !(v <= 1e7))
    return InvalidArgument(StrCat("--gflops=", text, ": must be a number in [0.001, 1e7] GFLOP/s"));
  return v;
}

StatusOr<nlohmann::json> ReadJsonFile(const std::string& path, bool* had_comments) {
  std::ifstream in(path);
  if (!in) return NotFound(StrCat(path, ": cannot open it"));
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string text = ss.str();
  const std::string plain = RelaxedJson(text);
  if (had_comments) *had_comments = plain != text;
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(plain);
  } catch (const nlohmann::json::exception& e) {
    return InvalidArgument(StrCat(path, ": not valid JSON (", e.what(), ")"));
  }
  if (!j.is_object()) return InvalidArgument(StrCat(path, ": not a JSON object"));
  return j;
}

Status WriteJsonFileAtomic(const std::string& path, const nlohmann::json& j) {
  const std::string tmp = StrCat(path, ".tmp.", getpid());
  const std::string text = j.dump(2) + "\n";
  int fd = open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return ErrnoToStatus(errno, StrCat("creating ", tmp));
  size_t done = 0;
  while (done < text.size()) {
    ssize_t n = write(fd, text.data() + done, text.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      Status s = ErrnoToStatus(errno, StrCat("writing ", tmp));
      close(fd);
      unlink(tmp.c_str());
      return s;
    }
    done += static_cast<size_t>(n);
  }
  if (fsync(fd) != 0 || close(fd) != 0) {
    Status s = ErrnoToStatus(errno, StrCat("syncing ", tmp));
    unlink(tmp.c_str());
    return s;
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    Status s = ErrnoToStatus(errno, StrCat("renaming ", tmp, " to ", path));
    unlink(tmp.c_str());
    return s;
  }
  return Status::Ok();
}

StatusOr<ModelSpec> ModelFromArgs(const nlohmann::json* raw, const Config& config,
                                  const std::string& params, const std::string& largest_layer) {
  if (!params.empty() || !largest_layer.empty()) {
    if (params.empty() || largest_layer.empty())
      return InvalidArgument("--params and --largest-layer go together (elements of the whole model and of "
                             "its largest layer)");
    STRATA_ASSIGN_OR_RETURN(int64_t p, ParseCount("--params", params, 1, int64_t{1} << 50));
    STRATA_ASSIGN_OR_RETURN(int64_t l, ParseCount("--largest-layer", largest_layer, 1, int64_t{1} << 50));
    return SyntheticModelSpec(p, l);
  }
  if (raw && raw->contains("model")) return GptModelSpec(config.model);
  return InvalidArgument(raw ? "the config has no \"model\" section: add one, or give the model's size with "
                               "--params N --largest-layer N"
                             : "no model: pass --config FILE (with a \"model\" section) or --params N "
                               "--largest-layer N");
}

}  // namespace strata::planner
