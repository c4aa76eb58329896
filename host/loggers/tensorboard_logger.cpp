// TensorBoard's event file: TFRecord framing (length, masked CRC-32C of the length, the
// serialized Event, masked CRC-32C of it) around Event protos from TensorBoard's own schema.
#include <unistd.h>

#include <chrono>

#include <boost/crc.hpp>

#include "loggers/logger.hpp"
#include "loggers/record_file.hpp"
#include "tensorboard/compat/proto/event.pb.h"
#include "tensorboard/plugins/hparams/plugin_data.pb.h"
#include "tessera/sdk/error.hpp"

namespace tessera::host {

namespace {

std::uint32_t masked_crc32c(const std::string& data) {
  boost::crc_optimal<32, 0x1EDC6F41, 0xFFFFFFFF, 0xFFFFFFFF, true, true> crc;  // Castagnoli
  crc.process_bytes(data.data(), data.size());
  std::uint32_t c = crc.checksum();
  return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}

double now_s() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

class TensorBoardLogger final : public Logger {
 public:
  explicit TensorBoardLogger(const std::string& dir) {
    char host[256] = "localhost";
    ::gethostname(host, sizeof(host) - 1);
    path_ = dir + "/events.out.tfevents." + std::to_string(static_cast<std::int64_t>(now_s())) + "." + host + "." +
            std::to_string(::getpid()) + ".0";
    out_ = RecordFile(path_, RecordFile::Mode::truncate);
    tensorboard::Event first;
    first.set_wall_time(now_s());
    first.set_file_version("brain.Event:2");
    write(first);
  }

  void log_hyperparams(const HyperParameters& params) override {
    // As PyTorch's SummaryWriter.add_hparams: an experiment (the columns) and a session
    // start (this run's values), both in the run's own folder.
    tensorboard::hparams::HParamsPluginData experiment, start;
    auto* session = start.mutable_session_start_info();
    session->set_start_time_secs(now_s());
    for (const auto& [name, value] : params) {
      auto* info = experiment.mutable_experiment()->add_hparam_infos();
      info->set_name(name);
      google::protobuf::Value& v = (*session->mutable_hparams())[name];
      if (auto* b = std::get_if<bool>(&value)) v.set_bool_value(*b), info->set_type(tensorboard::hparams::DATA_TYPE_BOOL);
      else if (auto* i = std::get_if<std::int64_t>(&value)) v.set_number_value(static_cast<double>(*i)), info->set_type(tensorboard::hparams::DATA_TYPE_FLOAT64);
      else if (auto* d = std::get_if<double>(&value)) v.set_number_value(*d), info->set_type(tensorboard::hparams::DATA_TYPE_FLOAT64);
      else v.set_string_value(std::get<std::string>(value)), info->set_type(tensorboard::hparams::DATA_TYPE_STRING);
    }
    for (const char* metric : {"train_loss", "val_loss"}) {
      auto* info = experiment.mutable_experiment()->add_metric_infos();
      info->mutable_name()->set_tag(metric);
    }
    write_hparams("_hparams_/experiment", experiment);
    write_hparams("_hparams_/session_start_info", start);
  }

  void log_metrics(const std::map<std::string, double>& metrics, std::int64_t step, std::int64_t,
                   const std::string&) override {
    tensorboard::Event event;
    event.set_wall_time(now_s());
    event.set_step(step);
    for (const auto& [name, value] : metrics) {
      auto* v = event.mutable_summary()->add_value();
      v->set_tag(name);
      v->set_simple_value(static_cast<float>(value));
    }
    write(event);
  }

  void finalize(const std::string& status) override {
    tensorboard::hparams::HParamsPluginData end;
    end.mutable_session_end_info()->set_end_time_secs(now_s());
    end.mutable_session_end_info()->set_status(status == "success" ? tensorboard::hparams::STATUS_SUCCESS
                                                                   : tensorboard::hparams::STATUS_FAILURE);
    write_hparams("_hparams_/session_end_info", end);
    out_.close();
  }

 private:
  void write_hparams(const std::string& tag, const tensorboard::hparams::HParamsPluginData& data) {
    tensorboard::Event event;
    event.set_wall_time(now_s());
    auto* v = event.mutable_summary()->add_value();
    v->set_tag(tag);
    v->mutable_metadata()->mutable_plugin_data()->set_plugin_name("hparams");
    v->mutable_metadata()->mutable_plugin_data()->set_content(data.SerializeAsString());
    write(event);
  }

  void write(const tensorboard::Event& event) {
    std::string data = event.SerializeAsString();
    std::string length(8, '\0');
    std::uint64_t n = data.size();
    for (int i = 0; i < 8; ++i) length[i] = static_cast<char>((n >> (8 * i)) & 0xff);  // little-endian
    auto put32 = [](std::string& out, std::uint32_t x) {
      const char b[4] = {static_cast<char>(x), static_cast<char>(x >> 8), static_cast<char>(x >> 16),
                         static_cast<char>(x >> 24)};
      out.append(b, 4);
    };
    std::string record = length;
    put32(record, masked_crc32c(length));
    record += data;
    put32(record, masked_crc32c(data));
    out_.write(record);  // one checked write per event: TensorBoard follows the file while the run goes on
  }

  std::string path_;
  RecordFile out_;
};

}  // namespace

std::unique_ptr<Logger> make_tensorboard_logger(const std::string& run_dir) {
  return std::make_unique<TensorBoardLogger>(run_dir);
}

}  // namespace tessera::host
