#include "runtime/base/relaxed_json.h"

#include <cctype>
#include <optional>

namespace strata {

std::string RelaxedJson(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  std::optional<size_t> pending_comma;  // where in `out` a comma that may be trailing sits
  size_t i = 0;
  const size_t n = text.size();
  while (i < n) {
    const char c = text[i];
    if (c == '"') {
      size_t j = i + 1;
      while (j < n && text[j] != '"') j += text[j] == '\\' ? 2 : 1;
      const size_t end = j < n ? j + 1 : n;
      out.append(text.substr(i, end - i));
      pending_comma.reset();
      i = end;
    } else if (c == '#' || text.substr(i, 2) == "//") {
      const size_t j = text.find('\n', i);
      i = j == std::string_view::npos ? n : j;
    } else if (text.substr(i, 2) == "/*") {
      const size_t j = text.find("*/", i + 2);
      const size_t end = j == std::string_view::npos ? n : j + 2;
      for (size_t k = i; k < end; ++k)
        if (text[k] == '\n') out.push_back('\n');
      i = end;
    } else if (c == ',') {
      pending_comma = out.size();
      out.push_back(c);
      ++i;
    } else if (c == '}' || c == ']') {
      if (pending_comma) out[*pending_comma] = ' ';
      pending_comma.reset();
      out.push_back(c);
      ++i;
    } else {
      if (!std::isspace(static_cast<unsigned char>(c))) pending_comma.reset();
      out.push_back(c);
      ++i;
    }
  }
  return out;
}

}  // namespace strata
