#include "runtime/base/env_vars.h"

#include <cstdlib>

namespace strata {

const char* GetEnv(const EnvVar& var) { return std::getenv(var.name); }

}  // namespace strata
