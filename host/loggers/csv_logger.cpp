#include <filesystem>
#include <iomanip>
#include <sstream>

#include <nlohmann/json.hpp>

#include "loggers/logger.hpp"
#include "loggers/record_file.hpp"

namespace tessera::host {

namespace {

class CsvLogger final : public Logger {
 public:
  explicit CsvLogger(std::string dir) : dir_(std::move(dir)) {
    std::string path = dir_ + "/metrics.csv";
    bool fresh = !std::filesystem::exists(path);
    csv_ = RecordFile(path, RecordFile::Mode::append);
    if (fresh) csv_.write("step,epoch,stage,metric,value\n");
  }

  void log_hyperparams(const HyperParameters& params) override {
    // JSON scalars are YAML scalars: strings come out quoted and escaped.
    std::ostringstream yaml;
    for (const auto& [key, value] : params)
      std::visit([&, &key = key](const auto& v) { yaml << key << ": " << nlohmann::json(v).dump() << "\n"; }, value);
    write_record(dir_ + "/hparams.yaml", yaml.str());
  }

  void log_metrics(const std::map<std::string, double>& metrics, std::int64_t step, std::int64_t epoch,
                   const std::string& stage) override {
    std::ostringstream rows;
    for (const auto& [name, value] : metrics)
      rows << step << "," << epoch << "," << stage << "," << name << "," << std::setprecision(8) << value << "\n";
    csv_.write(rows.str());
  }

  void finalize(const std::string&) override { csv_.close(); }

 private:
  std::string dir_;
  RecordFile csv_;
};

}  // namespace

std::unique_ptr<Logger> make_csv_logger(const std::string& run_dir) { return std::make_unique<CsvLogger>(run_dir); }

}  // namespace tessera::host
