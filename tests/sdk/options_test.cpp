#include <gtest/gtest.h>

#include <cmath>

#include "tessera/sdk/error.hpp"
#include "tessera/sdk/options.hpp"
#include "errors.hpp"
#include "tessera/sdk/toml_options.hpp"

namespace {

using tessera::sdk::Options;

Options parse(const std::string& text) { return tessera::sdk::make_options("strategy", "run.toml", toml::parse(text)); }

using tessera::testing::error_of;

TEST(Options, TypedGettersReadValuesAndDefaults) {
  Options o = parse("n = 3\nx = 2\ny = 0.5\nflag = true\nname = 'a'\nlist = ['p', 'q']\n");
  EXPECT_EQ(o.get_int("n", 0), 3);
  EXPECT_DOUBLE_EQ(o.get_double("x", 0), 2.0);  // an integer where a float is expected
  EXPECT_DOUBLE_EQ(o.get_double("y", 0), 0.5);
  EXPECT_TRUE(o.get_bool("flag", false));
  EXPECT_EQ(o.get_string("name", ""), "a");
  EXPECT_EQ(o.get_string_list("list", {}), (std::vector<std::string>{"p", "q"}));
  EXPECT_EQ(o.get_int("absent", 7), 7);
  EXPECT_NO_THROW(o.check_all_used());
}

TEST(Options, WrongTypeNamesFileLineAndKey) {
  Options o = parse("\nn = 'three'\n");
  std::string message = error_of([&] { o.get_int("n", 0); });
  EXPECT_NE(message.find("run.toml:2: [strategy] n must be an integer, found string"), std::string::npos) << message;
}

TEST(Options, OutOfRangeNamesTheRange) {
  Options o = parse("n = -1\n");
  std::string message = error_of([&] { o.get_int("n", 0, 1, 8); });
  EXPECT_NE(message.find("[strategy] n = -1 is out of range [1, 8]"), std::string::npos) << message;
  // A key's own default is always accepted, a NaN ("not set") too, as tessera config lists it;
  // any other NaN is out of range.
  Options nan = parse("threshold = nan\nother = nan\n");
  EXPECT_TRUE(std::isnan(nan.get_double("threshold", NAN)));
  message = error_of([&] { nan.get_double("other", 0.0); });
  EXPECT_NE(message.find("[strategy] other = nan is out of range"), std::string::npos) << message;
}

TEST(Options, ChoiceListsValidValuesWithSuggestion) {
  Options o = parse("sharding_strategy = 'FULL_SHRAD'\n");
  std::string message =
      error_of([&] { o.get_choice("sharding_strategy", "FULL_SHARD", {"FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"}); });
  EXPECT_NE(message.find("did you mean 'FULL_SHARD'?"), std::string::npos) << message;
  EXPECT_NE(message.find("valid: FULL_SHARD, SHARD_GRAD_OP, NO_SHARD"), std::string::npos) << message;
}

TEST(Options, UnusedKeyIsAnError) {
  Options o = parse("plugin = 'fsdp'\ncpu_ofload = true\n");
  o.get_bool("cpu_offload", false);
  std::string message = error_of([&] { o.check_all_used({"plugin"}); });
  EXPECT_NE(message.find("run.toml:2: [strategy] cpu_ofload is not a known key (did you mean 'cpu_offload'?)"),
            std::string::npos)
      << message;
}

// A key that takes more than one type is read through value() (no TOML++ type in the contract):
// the file's value with its type, neither marked used nor reported until the factory says so.
TEST(Options, ValuesKeysAndSubTablesWithoutTomlTypes) {
  Options o = parse(
      "size = 'auto'\nk = 4\nflag = false\nratio = 0.25\nlist = [1, 'a']\n"
      "[mp]\nparam_dtype = 'bfloat16'\n[mp.inner]\nx = 1\n");
  EXPECT_EQ(o.keys(), (std::vector<std::string>{"flag", "k", "list", "mp", "ratio", "size"}));
  EXPECT_TRUE(o.value("absent").absent());
  EXPECT_EQ(o.value("size").as<std::string>(), "auto");
  EXPECT_EQ(o.value("k").as<std::int64_t>(), 4);
  EXPECT_FALSE(o.value("flag").as<bool>());
  EXPECT_DOUBLE_EQ(o.value("ratio").as<double>(), 0.25);
  // as() on the temporary value() returns is a copy, so this reference does not dangle (ASan found
  // it dangling when as() returned a reference into the temporary).
  const auto& list = o.value("list").as<std::vector<tessera::sdk::Value>>();
  ASSERT_EQ(list.size(), 2u);
  EXPECT_EQ(list[1].as<std::string>(), "a");
  EXPECT_STREQ(o.value("k").type_name(), "integer");
  // Nothing was marked used by value(): every key is still unknown.
  EXPECT_NE(error_of([&] { o.check_all_used(); }).find("is not a known key"), std::string::npos);

  Options mp = o.sub_table("mp");
  EXPECT_EQ(mp.section(), "strategy.mp");
  EXPECT_EQ(mp.get_string("param_dtype", ""), "bfloat16");
  EXPECT_EQ(mp.sub_table("inner").get_int("x", 0), 1);
  EXPECT_TRUE(o.sub_table("absent_table").keys().empty());
  std::string message = error_of([&] { o.sub_table("k"); });
  EXPECT_NE(message.find("run.toml:2: [strategy] k must be a table, e.g. [strategy.k]"), std::string::npos) << message;

  // note_key reports a hand-parsed key with its default, as the getters do.
  std::vector<std::string> reported;
  auto previous = Options::observe_keys([&](const Options&, const tessera::sdk::KeyRecord& record) {
    reported.push_back(record.key.name + "=" + (record.fallback.is<std::string>() ? record.fallback.as<std::string>()
                                                                                  : record.fallback.type_name()));
  });
  o.note_key({"size", "a doc"}, "auto");
  o.get_int("k", 1);
  Options::observe_keys(std::move(previous));
  EXPECT_EQ(reported, (std::vector<std::string>{"size=auto", "k=integer"}));
}

// sdk::Value has no date or time: one in a key is refused by every read, naming the key, never
// taken for a string.
TEST(Options, DatesAndTimesAreRefusedNamingTheKey) {
  Options o = parse("name = 1979-05-27\nlist = ['a', 07:32:00]\n");
  std::string message = error_of([&] { o.get_string("name", ""); });
  EXPECT_NE(message.find("run.toml:1: [strategy] name holds a TOML date, which no key takes"), std::string::npos)
      << message;
  message = error_of([&] { o.get_string_list("list", {}); });
  EXPECT_NE(message.find("run.toml:2: [strategy] list holds a TOML time"), std::string::npos) << message;
  EXPECT_NE(error_of([&] { o.value("name"); }).find("holds a TOML date"), std::string::npos);
}

TEST(Suggestions, OnlyPlausibleTyposAreSuggested) {
  EXPECT_EQ(tessera::sdk::closest_match("fsdpp", {"fsdp", "ddp", "single_device"}), "fsdp");
  EXPECT_EQ(tessera::sdk::closest_match("xyzzy", {"fsdp", "ddp"}), "");
}

}  // namespace
