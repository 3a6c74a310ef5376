#include "tools/train/plot.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <limits>
#include <sstream>

namespace strata::train {
namespace {

constexpr double kW = 760, kPanelH = 230, kLeft = 70, kRight = 20, kTop = 40, kGap = 50;

std::string Num(double v) {
  char b[32];
  if (std::fabs(v) >= 1000) std::snprintf(b, sizeof b, "%.0f", v);
  else if (std::fabs(v) >= 10) std::snprintf(b, sizeof b, "%.1f", v);
  else std::snprintf(b, sizeof b, "%.3g", v);
  return b;
}

void Panel(std::ostringstream& o, double y0, const std::vector<Series>& series,
           const std::string& label) {
  double xmin = std::numeric_limits<double>::max(), xmax = -xmin, ymin = xmin, ymax = -xmin;
  for (const auto& s : series)
    for (size_t i = 0; i < s.x.size(); ++i) {
      if (!std::isfinite(s.y[i])) continue;
      xmin = std::min(xmin, s.x[i]);
      xmax = std::max(xmax, s.x[i]);
      ymin = std::min(ymin, s.y[i]);
      ymax = std::max(ymax, s.y[i]);
    }
  if (xmin > xmax) xmin = 0, xmax = 1, ymin = 0, ymax = 1;
  if (xmax == xmin) xmax = xmin + 1;
  if (ymax == ymin) ymax = ymin + 1;
  const double pad = 0.05 * (ymax - ymin);
  ymin -= pad;
  ymax += pad;
  const double pw = kW - kLeft - kRight;
  auto X = [&](double x) { return kLeft + (x - xmin) / (xmax - xmin) * pw; };
  auto Y = [&](double y) { return y0 + kPanelH - (y - ymin) / (ymax - ymin) * kPanelH; };
  o << "<rect x='" << kLeft << "' y='" << y0 << "' width='" << pw << "' height='" << kPanelH
    << "' fill='none' stroke='#888'/>\n";
  for (int i = 0; i <= 4; ++i) {
    double yv = ymin + (ymax - ymin) * i / 4.0;
    o << "<line x1='" << kLeft << "' x2='" << kLeft + pw << "' y1='" << Y(yv) << "' y2='" << Y(yv)
      << "' stroke='#eee'/>\n<text x='" << kLeft - 6 << "' y='" << Y(yv) + 4
      << "' text-anchor='end' font-size='11'>" << Num(yv) << "</text>\n";
    double xv = xmin + (xmax - xmin) * i / 4.0;
    if (xmax - xmin >= 4) xv = std::round(xv);  // steps are whole numbers
    o << "<text x='" << X(xv) << "' y='" << y0 + kPanelH + 15 << "' text-anchor='middle' font-size='11'>"
      << Num(xv) << "</text>\n";
  }
  o << "<text x='16' y='" << y0 + kPanelH / 2 << "' font-size='12' transform='rotate(-90 16 "
    << y0 + kPanelH / 2 << ")' text-anchor='middle'>" << label << "</text>\n";
  double lx = kLeft + 10;
  for (const auto& s : series) {
    o << "<polyline fill='none' stroke='" << s.color << "' stroke-width='1.6' points='";
    for (size_t i = 0; i < s.x.size(); ++i)
      if (std::isfinite(s.y[i])) o << X(s.x[i]) << "," << Y(s.y[i]) << " ";
    o << "'/>\n";
    if (s.x.size() == 1)
      o << "<circle cx='" << X(s.x[0]) << "' cy='" << Y(s.y[0]) << "' r='3' fill='" << s.color << "'/>\n";
    o << "<rect x='" << lx << "' y='" << y0 + 8 << "' width='12' height='3' fill='" << s.color
      << "'/><text x='" << lx + 16 << "' y='" << y0 + 13 << "' font-size='11'>" << s.name << "</text>\n";
    lx += 20 + 7 * s.name.size();
  }
}

}  // namespace

Status WriteTrainingSvg(const std::string& path, const std::string& title,
                        const std::vector<Series>& top, const std::string& top_label,
                        const std::vector<Series>& bottom, const std::string& bottom_label) {
  const double h = kTop + 2 * kPanelH + kGap + 40;
  std::ostringstream o;
  o << "<svg xmlns='http://www.w3.org/2000/svg' width='" << kW << "' height='" << h
    << "' font-family='sans-serif'>\n<rect width='100%' height='100%' fill='white'/>\n"
    << "<text x='" << kW / 2 << "' y='22' text-anchor='middle' font-size='15'>" << title << "</text>\n";
  Panel(o, kTop, top, top_label);
  Panel(o, kTop + kPanelH + kGap, bottom, bottom_label);
  o << "<text x='" << kW / 2 << "' y='" << h - 6 << "' text-anchor='middle' font-size='12'>step</text>\n</svg>\n";
  std::ofstream out(path, std::ios::trunc);
  if (!out) return ErrnoToStatus(errno, StrCat("cannot write plot ", path));
  out << o.str();
  if (!out) return ErrnoToStatus(errno, StrCat("cannot write plot ", path));
  return Status::Ok();
}

}  // namespace strata::train
