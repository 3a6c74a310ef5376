// The JSON-shaped files DeepSpeed reads (it parses configs with hjson): `//`, `#` and `/* */`
// comments and trailing commas are accepted. RelaxedJson removes them, keeping everything inside
// strings and every line break (so a parse error still names the right line), and leaves plain
// JSON for a strict parser. The Python package's config.relaxed_json does the same, so a file
// loads alike from strata-train and from a script.
#pragma once

#include <string>
#include <string_view>

namespace strata {

std::string RelaxedJson(std::string_view text);

}  // namespace strata
