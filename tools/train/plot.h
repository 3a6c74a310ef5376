// A small SVG line chart, written by hand so that strata-train needs no plotting library.
#pragma once

#include <string>
#include <vector>

#include "runtime/base/status.h"

namespace strata::train {

struct Series {
  std::string name;
  std::string color;  // CSS color
  std::vector<double> x, y;
};

// Two stacked panels (e.g. loss above, throughput below), each with its own y axis.
Status WriteTrainingSvg(const std::string& path, const std::string& title,
                        const std::vector<Series>& top, const std::string& top_label,
                        const std::vector<Series>& bottom, const std::string& bottom_label);

}  // namespace strata::train
