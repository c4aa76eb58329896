// `tessera report` (issue 60.3): a small GPT fit on 2 ranks, resumed once from its checkpoint into
// a second run folder; the report of the second joins both into one curve. The page is checked as
// text (inline SVG, no script, nothing fetched, every logged step in the curves, both ranks'
// memory) and as Chromium renders it: a headless screenshot, decoded here, shows each curve's
// colour, the loss curve spanning many pixel rows (it falls), in the plot areas.
#include <gtest/gtest.h>

#include <zlib.h>

#include <algorithm>
#include <array>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "multiprocess.hpp"

namespace {

namespace fs = std::filesystem;
using tessera::testing::run_command;
using tessera::testing::run_tessera;

using tessera::testing::read_file;

struct Runs {
  fs::path root, second, page;
  std::string fit1, fit2, report;
};

/// Two run folders: steps 1-6, then resumed from its last checkpoint to step 12.
Runs make_runs() {
  Runs r;
  r.root = tessera::testing::fresh_dir("report");
  const std::string sets =
      " --set trainer.default_root_dir=" + r.root.string() +
      " --set trainer.enable_progress_bar=false --set trainer.predict_after_fit=false --set model.n_layer=1"
      " --set model.n_embd=32 --set model.n_head=2 --set model.block_size=32 --set data.block_size=32"
      " --set data.batch_size=4 --set trainer.log_every_n_steps=2 --set trainer.val_check_interval=3"
      " --set trainer.limit_val_batches=2 --set trainer.checkpoint_every_n_steps=0 --set optimizer.warmup_steps=4";
  const std::string config = " --config " TESSERA_SOURCE_DIR "/configs/gpt-fortunes.toml";
  auto fit = run_tessera("fit" + config + sets + " --set trainer.max_steps=6 2>&1", "", 120);
  r.fit1 = fit.output;
  EXPECT_EQ(fit.exit_code, 0) << fit.output;
  fit = run_tessera("fit" + config + sets + " --set trainer.max_steps=12 --ckpt-path last 2>&1", "", 120);
  r.fit2 = fit.output;
  EXPECT_EQ(fit.exit_code, 0) << fit.output;
  r.second = r.root / "version_1";
  auto report = run_tessera("report " + r.second.string() + " 2>&1");
  r.report = report.output;
  EXPECT_EQ(report.exit_code, 0) << report.output;
  r.page = r.second / "report.html";
  return r;
}

/// The points of one polyline (data-series=name) of chart `id`.
std::vector<std::pair<double, double>> polyline(const std::string& html, const std::string& id, const std::string& name) {
  const std::size_t chart = html.find("<svg id=\"" + id + "\"");
  if (chart == std::string::npos) return {};
  const std::size_t end = html.find("</svg>", chart);
  const std::size_t at = html.find("data-series=\"" + name + "\"", chart);
  if (at == std::string::npos || at > end) return {};
  const std::size_t p = html.find("points=\"", at) + 8;
  std::istringstream in(html.substr(p, html.find('"', p) - p));
  std::vector<std::pair<double, double>> out;
  std::string pair;
  while (in >> pair) out.emplace_back(std::stod(pair.substr(0, pair.find(','))), std::stod(pair.substr(pair.find(',') + 1)));
  return out;
}

TEST(Report, JoinsAResumedRunIntoOneSelfContainedPage) {
  const Runs r = make_runs();
  ASSERT_TRUE(fs::exists(r.page)) << r.report;
  EXPECT_NE(r.fit2.find("(resuming at step 6)"), std::string::npos) << r.fit2;
  EXPECT_NE(r.report.find("report of 2 run(s)"), std::string::npos) << r.report;
  const std::string html = read_file(r.page);
  // Self-contained: no script, nothing fetched (no src, href, url() or import), SVG inline.
  for (const char* banned : {"<script", "src=", "href=", "url(", "@import", "<link", "<img", "<iframe"})
    EXPECT_EQ(html.find(banned), std::string::npos) << banned;
  for (const char* id : {"loss", "lr", "rate", "memory"})
    EXPECT_NE(html.find("<svg id=\"" + std::string(id) + "\""), std::string::npos) << id;
  // Both folders, oldest first, and the step the second begins at (a dashed rule in each chart).
  EXPECT_NE(html.find("runs joined</th><td>2<br>" + (r.root / "version_0").string() + "<br>" + r.second.string()),
            std::string::npos);
  EXPECT_NE(html.find("<title>resumed at step 7</title>"), std::string::npos);
  // train_loss at the logged steps of both runs: 1, 2, 4, 6 then 7, 8, 10, 12; x grows.
  const auto train = polyline(html, "loss", "train_loss");
  ASSERT_EQ(train.size(), 8u) << html.substr(html.find("<svg id=\"loss\""), 3000);
  EXPECT_TRUE(std::is_sorted(train.begin(), train.end()));
  EXPECT_GE(polyline(html, "loss", "val_loss").size(), 4u);  // steps 3, 6, 9, 12
  EXPECT_EQ(polyline(html, "lr", "lr").size(), 8u);
  EXPECT_EQ(polyline(html, "rate", "rank 0").size(), 8u);
  EXPECT_EQ(polyline(html, "rate", "rank 1").size(), 8u);
  // Each rank's own peak RSS, as its log records it.
  const std::size_t memory = html.find("<svg id=\"memory\"");
  ASSERT_NE(memory, std::string::npos);
  EXPECT_NE(html.find("<title>rank 0: ", memory), std::string::npos);
  EXPECT_NE(html.find("<title>rank 1: ", memory), std::string::npos);
  // The run's config, escaped.
  EXPECT_NE(html.find("plugin = &quot;gpt&quot;"), std::string::npos);
  // A folder that is no run is refused, naming it.
  const auto bad = run_tessera("report " + r.root.string() + " 2>&1");
  EXPECT_EQ(bad.exit_code, 1) << bad.output;
  EXPECT_NE(bad.output.find(r.root.string() + " holds neither config.toml nor metrics.csv"), std::string::npos)
      << bad.output;
}

// --- a PNG reader: 8-bit RGB / RGBA, non-interlaced (what Chromium's screenshots are) ---------

struct Image {
  int width = 0, height = 0, channels = 0;
  std::vector<unsigned char> pixels;  ///< rows of width x channels bytes
  std::array<int, 3> at(int x, int y) const {
    const unsigned char* p = &pixels[(static_cast<std::size_t>(y) * width + x) * channels];
    return {p[0], p[1], p[2]};
  }
};

std::uint32_t be32(const unsigned char* p) {
  return (std::uint32_t(p[0]) << 24) | (std::uint32_t(p[1]) << 16) | (std::uint32_t(p[2]) << 8) | p[3];
}

Image read_png(const std::string& bytes) {
  Image image;
  const auto* data = reinterpret_cast<const unsigned char*>(bytes.data());
  if (bytes.size() < 8 || bytes.compare(0, 8, "\x89PNG\r\n\x1a\n") != 0) return image;
  std::string idat;
  int depth = 0, colour = 0, interlace = 0;
  for (std::size_t at = 8; at + 8 <= bytes.size();) {
    const std::uint32_t length = be32(data + at);
    const std::string type = bytes.substr(at + 4, 4);
    const unsigned char* body = data + at + 8;
    if (type == "IHDR") {
      image.width = static_cast<int>(be32(body)), image.height = static_cast<int>(be32(body + 4));
      depth = body[8], colour = body[9], interlace = body[12];
    } else if (type == "IDAT") {
      idat.append(reinterpret_cast<const char*>(body), length);
    }
    at += 12 + length;
  }
  if (depth != 8 || (colour != 2 && colour != 6) || interlace != 0) return Image{};
  image.channels = colour == 6 ? 4 : 3;
  const std::size_t stride = static_cast<std::size_t>(image.width) * image.channels;
  std::vector<unsigned char> raw((stride + 1) * image.height);
  uLongf size = raw.size();
  if (uncompress(raw.data(), &size, reinterpret_cast<const Bytef*>(idat.data()), idat.size()) != Z_OK) return Image{};
  image.pixels.assign(stride * image.height, 0);
  const int bpp = image.channels;
  for (int y = 0; y < image.height; ++y) {
    const unsigned char filter = raw[y * (stride + 1)];
    const unsigned char* in = &raw[y * (stride + 1) + 1];
    unsigned char* out = &image.pixels[y * stride];
    const unsigned char* up = y > 0 ? &image.pixels[(y - 1) * stride] : nullptr;
    for (std::size_t i = 0; i < stride; ++i) {
      const int a = i >= static_cast<std::size_t>(bpp) ? out[i - bpp] : 0, b = up ? up[i] : 0;
      const int c = up && i >= static_cast<std::size_t>(bpp) ? up[i - bpp] : 0;
      int predicted = 0;
      if (filter == 1) predicted = a;
      else if (filter == 2) predicted = b;
      else if (filter == 3) predicted = (a + b) / 2;
      else if (filter == 4) {
        const int p = a + b - c, pa = std::abs(p - a), pb = std::abs(p - b), pc = std::abs(p - c);
        predicted = pa <= pb && pa <= pc ? a : (pb <= pc ? b : c);
      }
      out[i] = static_cast<unsigned char>(in[i] + predicted);
    }
  }
  return image;
}

/// Pixels within `tolerance` of `rgb` (per channel): their count and the rows they span.
struct Found {
  int count = 0, top = 1 << 30, bottom = -1;
};

Found find_colour(const Image& image, std::array<int, 3> rgb, int tolerance = 12) {
  Found f;
  for (int y = 0; y < image.height; ++y)
    for (int x = 0; x < image.width; ++x) {
      const auto p = image.at(x, y);
      if (std::abs(p[0] - rgb[0]) <= tolerance && std::abs(p[1] - rgb[1]) <= tolerance &&
          std::abs(p[2] - rgb[2]) <= tolerance) {
        ++f.count;
        f.top = std::min(f.top, y), f.bottom = std::max(f.bottom, y);
      }
    }
  return f;
}

TEST(Report, RendersTheCurvesInHeadlessChromium) {
  const std::string chromium = CHROMIUM_EXECUTABLE;
  if (chromium.empty())
    GTEST_SKIP() << "SKIPPED: no chromium found at configure time (Debian's `chromium`, in .ci/debian-packages); "
                    "Report.JoinsAResumedRunIntoOneSelfContainedPage checks the page's structure";
  const Runs r = make_runs();
  ASSERT_TRUE(fs::exists(r.page)) << r.report;
  const fs::path png = r.root / "report.png";
  // A private profile folder, no network (nothing to fetch anyway), no sandbox (CI runs as root).
  const auto shot = run_command("timeout 120 " + chromium + " --headless --no-sandbox --disable-gpu --hide-scrollbars" +
                                " --no-first-run --user-data-dir=" + (r.root / "chromium-profile").string() +
                                " --window-size=820,1900 --screenshot=" + png.string() + " file://" + r.page.string() +
                                " 2>&1");
  ASSERT_EQ(shot.exit_code, 0) << shot.output;
  const Image image = read_png(read_file(png));
  ASSERT_EQ(image.width, 820) << shot.output;
  ASSERT_EQ(image.height, 1900);
  // The loss chart: train (#1f77b4) falls over many pixel rows; validation (#ff7f0e) drawn too.
  const Found train = find_colour(image, {0x1f, 0x77, 0xb4}), val = find_colour(image, {0xff, 0x7f, 0x0e});
  EXPECT_GE(train.count, 400) << "train_loss curve";
  EXPECT_GE(train.bottom - train.top, 60) << "the train loss curve spans rows " << train.top << ".." << train.bottom;
  EXPECT_GE(val.count, 150) << "val_loss curve";
  // Learning rate (#2ca02c: warmup then cosine), each rank's throughput (#9467bd, #8c564b), the
  // memory bars (#d62728), each below the previous chart.
  const Found lr = find_colour(image, {0x2c, 0xa0, 0x2c}), rank0 = find_colour(image, {0x94, 0x67, 0xbd}),
              rank1 = find_colour(image, {0x8c, 0x56, 0x4b}), bars = find_colour(image, {0xd6, 0x27, 0x28});
  EXPECT_GE(lr.count, 300) << "learning-rate curve";
  EXPECT_GE(rank0.count, 300) << "rank 0's throughput";
  EXPECT_GE(rank1.count, 300) << "rank 1's throughput";
  EXPECT_GE(bars.count, 2000) << "two memory bars";
  EXPECT_LT(train.bottom, lr.top + 40) << "the loss chart above the learning rate's";
  EXPECT_LT(lr.bottom, rank0.top + 40) << "the learning rate above the throughput";
  EXPECT_LT(rank0.bottom, bars.top) << "the throughput above the memory bars";
}

}  // namespace
