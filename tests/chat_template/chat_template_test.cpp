// The toolkit's chat templates against python3-jinja2 configured as transformers configures it
// (jinja_reference.py), byte for byte: the constructs one by one, then the real chat templates
// of current model families (models/, see models/SOURCES.md) on conversations with system
// prompts, many turns and tool calls (conversations.jsonl), then `tessera tokenizer chat`.
// Also what must be refused: constructs outside the subset (by line and column), syntax
// errors, and hostile templates (the render budget).
#include <gtest/gtest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>

#include "multiprocess.hpp"
#include "sanitizers.hpp"
#include "tessera/toolkit/chat_template.hpp"

namespace {

namespace fs = std::filesystem;
using json = nlohmann::ordered_json;
using tessera::toolkit::ChatTemplate;
using tessera::toolkit::JinjaTemplate;
using tessera::toolkit::RenderOptions;
using tessera::toolkit::TemplateError;

const fs::path kDir = CHAT_TEMPLATE_TEST_DIR;
constexpr const char* kNow = "2024-09-03T10:20:30";

// The fixed time strftime_now sees on both sides (local time, as datetime.fromisoformat gives).
RenderOptions fixed_time() {
  std::tm tm{};
  strptime(kNow, "%Y-%m-%dT%H:%M:%S", &tm);
  tm.tm_isdst = -1;
  RenderOptions options;
  options.now = std::chrono::system_clock::from_time_t(std::mktime(&tm));
  return options;
}

using tessera::testing::read_file;

const fs::path kScratch = fs::temp_directory_path() / ("tessera_chat_template_test_" + std::to_string(getpid()));

fs::path scratch(const std::string& name) {
  const fs::path dir = kScratch / name;
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

struct RemoveScratch : ::testing::Environment {
  void TearDown() override { fs::remove_all(kScratch); }
};
const auto* const kRemoveScratch = ::testing::AddGlobalTestEnvironment(new RemoveScratch);

// Runs `command` with stdin from `input`, returns (exit code, stdout).
std::pair<int, std::string> run(const std::string& command, const fs::path& input = "/dev/null") {
  const std::string line = command + " < '" + input.string() + "'";
  FILE* pipe = popen(line.c_str(), "r");
  std::string out;
  if (!pipe) return {-1, out};
  char buffer[4096];
  for (std::size_t n; (n = fread(buffer, 1, sizeof buffer, pipe)) > 0;) out.append(buffer, n);
  const int status = pclose(pipe);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, out};
}

std::vector<json> lines_of(const std::string& text) {
  std::vector<json> lines;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);)
    if (!line.empty()) lines.push_back(json::parse(line));
  return lines;
}

const std::string kReference = "/usr/bin/python3 '" + (kDir / "jinja_reference.py").string() + "'";

// What a render gave: the text, or the failure (and whether raise_exception raised it).
struct Outcome {
  bool ok = false;
  std::string text;
  bool raised = false;
};

Outcome tessera_render(const std::string& source, const std::string& variables) {
  Outcome o;
  try {
    o.text = JinjaTemplate(source, "case").render(variables, fixed_time());
    o.ok = true;
  } catch (const TemplateError& e) {
    o.raised = e.kind() == TemplateError::Kind::raised;
    o.text = e.kind() == TemplateError::Kind::raised ? e.message() : e.what();
  }
  return o;
}

std::vector<Outcome> reference_render(const std::vector<std::pair<std::string, std::string>>& cases) {
  const fs::path input = scratch("reference") / "cases.jsonl";
  {
    std::ofstream out(input);
    for (const auto& [source, variables] : cases)
      out << json{{"template", source}, {"variables", json::parse(variables)}, {"now", kNow}}.dump() << "\n";
  }
  const auto [code, out] = run(kReference + " render", input);
  EXPECT_EQ(code, 0) << out;
  std::vector<Outcome> outcomes;
  for (const auto& line : lines_of(out)) {
    Outcome o;
    o.ok = line.contains("ok");
    o.text = o.ok ? line["ok"].get<std::string>() : line["error"].get<std::string>();
    o.raised = !o.ok && line["raised"].get<bool>();
    // raise_exception's message is the template's text after "TemplateError: ".
    if (o.raised) o.text = o.text.substr(std::string("TemplateError: ").size());
    outcomes.push_back(o);
  }
  return outcomes;
}

// Renders every case on both sides: equal text, or both refuse (raise_exception with one message).
void expect_same(const std::vector<std::pair<std::string, std::string>>& cases) {
  const auto reference = reference_render(cases);
  ASSERT_EQ(reference.size(), cases.size());
  for (std::size_t i = 0; i < cases.size(); ++i) {
    const Outcome ours = tessera_render(cases[i].first, cases[i].second);
    const Outcome& theirs = reference[i];
    SCOPED_TRACE("case " + std::to_string(i) + ": " + cases[i].first + "\nvariables: " + cases[i].second);
    EXPECT_EQ(ours.ok, theirs.ok) << "Tessera: " << ours.text << "\njinja2: " << theirs.text;
    if (ours.ok && theirs.ok) EXPECT_EQ(ours.text, theirs.text);
    if (theirs.raised) EXPECT_EQ(ours.text, theirs.text);
  }
}

TEST(ChatTemplate, ConstructsRenderAsJinja2) {
  const std::string v = R"({"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " Hi there "},
      {"role": "assistant", "content": "Hello!", "tool_calls": [{"function": {"name": "f", "arguments": {"x": 1, "y": [true, null, 2.5]}}}]}],
      "d": {"b": 2, "a": 1, "items": "key named items"}, "l": [3, 1, 2], "s": "héllo wörld", "n": null, "t": true,
      "f": 1.0, "i": 7, "big": 1e16, "small": 1.5e-7, "neg": -3, "e": "", "empty": [], "nested": {"x": {"y": {"z": "deep"}}},
      "names": ["Bob", "alice", "Carol", "bob"], "people": [{"name": "A", "age": 30}, {"name": "B", "age": 25}, {"name": "C"}]})";
  const std::vector<std::string> templates = {
      // Data, whitespace control, trim_blocks and lstrip_blocks.
      "plain text\n", "a\r\nb\rc\n\n", "  {% if true %}\n    yes\n  {% endif %}\ndone", "{% if true -%}   x   {%- endif %}.",
      "x  {{- 'y' -}}  z", "{#- comment -#}  a  {# c #}\nb", "line\n    {# indented comment #}\nnext", "{%+ if true %}kept{% endif %}",
      "{% if true +%}\nkeep newline{% endif %}", "{% raw %}{{ not rendered }}{% endraw %}", "  {%- raw -%}  x  {%- endraw -%}  ",
      "{{ 'a' }}\n{{ 'b' }}\n", "{% for m in messages %}\n  {{ m.role }}\n{% endfor %}\n",
      // Literals and printing as Python prints.
      "{{ 1 }} {{ 1.0 }} {{ -0.0 }} {{ 1.5 }} {{ 1e3 }} {{ 1_000 }} {{ 0x1F }} {{ 0o17 }} {{ 0b101 }} {{ 2.5e-5 }}",
      "{{ True }} {{ false }} {{ none }} {{ None }} {{ [1, 'a', \"b'c\", none, true, 1.0] }} {{ {'k': (1,)} }} {{ (1, 2) }} {{ () }}",
      "{{ big }} {{ small }} {{ f }} {{ 0.1 + 0.2 }} {{ 1/3 }} {{ 10/2 }} {{ 2**0.5 }} {{ 1e300 * 1e10 }}",
      R"({{ "tab\there" }} {{ 'nl\nx' }} {{ "\x41\u00e9\U0001F600\101" }} {{ '\d\\' }} {{ "q\"q" }} {{ 'a' 'b' "c" }})",
      "{{ 'it\\'s' }} {{ [\"it's\", 'say \"hi\"', 'both \\' \"'] }} {{ ['\\n', '\\x00', '\\u00e9', '\\u200b'] }}",
      "{{ d }} {{ l }} {{ nested }} {{ people }} {{ n }} {{ t }} {{ e }} {{ empty }}",
      // Arithmetic, comparison, logic.
      "{{ 7 // 2 }} {{ -7 // 2 }} {{ 7 % -3 }} {{ -7 % 3 }} {{ 7.5 // 2 }} {{ -7.5 % 2 }} {{ 2 ** 10 }} {{ 2 ** -1 }} {{ 2**3**2 }} {{ -2**2 }}",
      "{{ 1 + 2 * 3 }} {{ (1 + 2) * 3 }} {{ 'ab' * 3 }} {{ [1] * 2 }} {{ 3 * 'x' }} {{ [1] + [2] }} {{ 'a' ~ 1 ~ none ~ 2.0 }} {{ true + 1 }}",
      "{{ 1 < 2 < 3 }} {{ 3 > 2 > 2 }} {{ 1 == 1.0 }} {{ 'a' < 'b' }} {{ [1, 2] < [1, 3] }} {{ 1 != 2 }} {{ none == none }}",
      "{{ 'ell' in s }} {{ 2 in l }} {{ 'a' in d }} {{ 'z' not in d }} {{ 5 in l }} {{ 'x' in missing }}",
      "{{ 0 or 'x' }} {{ 1 and 'y' }} {{ '' and 'z' }} {{ none or [] }} {{ not 0 }} {{ not not 'a' }} {{ e or n or 'last' }}",
      "{{ 'yes' if t else 'no' }} {{ 'yes' if n else 'no' }} {{ 'a' if false }}| {{ 1 if 0 else 2 if 0 else 3 }}",
      // Attributes, items, slices, undefined.
      "{{ messages[0].role }} {{ messages[0]['content'] }} {{ messages[-1].role }} {{ messages[5] }}|{{ d.a }} {{ d['b'] }} {{ d.zz }}|{{ d['items'] }}",
      "{{ l[1:] }} {{ l[:-1] }} {{ l[::-1] }} {{ l[::2] }} {{ s[1:4] }} {{ s[::-1] }} {{ s[-3:] }} {{ l[5:] }} {{ s[10:20] }}|{{ l[:undefinedthing] }}|",
      "{{ s[0] }} {{ s[-1] }} {{ s[100] }}|{{ n.x }}|{{ n[0] }}|{{ nested.x.y.z }} {{ nested['x']['y'] }} {{ messages.0.role }}",
      "{{ missing }}|{{ missing is defined }} {{ missing is undefined }} {{ missing|length }} {{ missing == missing }} {{ missing ~ 'x' }}",
      "{% for x in missing %}never{% else %}else{% endfor %} {{ missing|default('dflt') }} {{ e|default('dflt') }} {{ e|default('dflt', true) }} {{ n|d('x') }}",
      "{{ messages[2].tool_calls[0].function.arguments|tojson }} {{ messages[2].tool_calls[0].function.arguments.y }}",
      // Tests.
      "{{ n is none }} {{ s is string }} {{ d is mapping }} {{ l is iterable }} {{ s is iterable }} {{ i is iterable }} {{ l is sequence }} {{ d is sequence }}",
      "{{ i is number }} {{ f is number }} {{ t is number }} {{ i is integer }} {{ t is integer }} {{ f is float }} {{ t is boolean }} {{ i is boolean }}",
      "{{ t is true }} {{ 1 is true }} {{ false is false }} {{ 4 is even }} {{ 3 is odd }} {{ 9 is divisibleby 3 }} {{ 9 is divisibleby(4) }}",
      "{{ 1 is eq 1 }} {{ 1 is equalto 2 }} {{ 2 is gt 1 }} {{ 2 is ge 2 }} {{ 1 is lt 0 }} {{ 'a' is in 'abc' }} {{ 1 is ne 1 }}",
      "{{ 'abc' is lower }} {{ 'ABC' is upper }} {{ 'aBc' is lower }} {{ range is callable }} {{ s.upper is callable }} {{ s is not string }}",
      "{{ missing is not defined }} {{ messages[0].content is defined }} {{ messages[0].nope is defined }} {{ n is sameas none }}",
      // Filters.
      "[{{ messages[1].content|trim }}] [{{ '  x  '|trim }}] [{{ 'xxaxx'|trim('x') }}] {{ s|length }} {{ l|count }} {{ d|length }} {{ s|upper }} {{ 'ABC'|lower }}",
      "{{ l|first }} {{ l|last }} {{ s|first }} {{ empty|first }}|{{ l|join(', ') }} {{ names|join }} {{ people|join('/', attribute='name') }}",
      "{{ 'hello world-foo(bar)'|title }} {{ 'hELLO wORLD'|capitalize }} {{ 'straße'|upper }} {{ 'İ'|lower|length }} {{ 'ǆ hi'|title }}",
      "{{ 'a-b-c'|replace('-', '+') }} {{ 'aaa'|replace('a', 'b', 2) }} {{ 1|string }} {{ [1, 'a']|string }} {{ none|string }} {{ 3.0|string }}",
      "{{ '42'|int }} {{ '  7 '|int }} {{ '3.9'|int }} {{ 'x'|int }} {{ 'x'|int(5) }} {{ '0x1A'|int(0, 16) }} {{ 3.9|int }} {{ true|int }} {{ '2'|float }} {{ 'nan'|float }} {{ 'y'|float }}",
      "{{ -3|abs }} {{ neg|abs }} {{ -2.5|abs }} {{ 2.5|round }} {{ 3.5|round }} {{ 2.675|round(2) }} {{ 2.1|round(0, 'ceil') }} {{ 2.9|round(0, 'floor') }} {{ 7|round }}",
      "{{ d|items|list }} {% for k, v in d|items %}{{ k }}={{ v }};{% endfor %} {{ d.items()|list }} {{ d.keys()|list }} {{ d.values()|list }} {{ d.items() }}",
      "{{ d.get('a') }} {{ d.get('zz') }} {{ d.get('zz', 'dflt') }} {{ d|dictsort }} {{ d|dictsort(by='value', reverse=true) }} {{ missing|items|list }}",
      "{{ l|list }} {{ s|list }} {{ d|list }} {{ l|sort }} {{ l|sort(reverse=true) }} {{ names|sort }} {{ names|sort(case_sensitive=true) }} {{ l|reverse|list }} {{ s|reverse }}",
      "{{ people|sort(attribute='name', reverse=true)|map(attribute='name')|list }} {{ people|map(attribute='age')|list }} {{ people|map(attribute='age', default=0)|list }}",
      "{{ names|map('upper')|list }} {{ names|unique|list }} {{ names|unique(case_sensitive=true)|list }} {{ people|selectattr('age')|list|length }}",
      "{{ people|selectattr('age', 'gt', 26)|map(attribute='name')|list }} {{ people|rejectattr('age', 'defined')|list }} {{ l|select('odd')|list }} {{ l|reject('lt', 2)|list }}",
      "{{ messages|selectattr('role', 'equalto', 'user')|list|length }} {{ messages|selectattr('role', '==', 'system')|first }} {{ l|select|list }}",
      "{{ l|sum }} {{ people|sum(attribute='age', start=1) if false else 'x' }} {{ l|min }} {{ l|max }} {{ names|min }} {{ names|max(case_sensitive=true) }}",
      "{{ 'one two  three'|wordcount }} {{ l|batch(2)|list }} {{ l|batch(2, 0)|list }} {{ '<b>'|e }} {{ '<b>'|escape }} {{ 'x'|safe }} {{ ('<' | safe) + '<' }}",
      "{{ 'a\\nb\\n\\nc'|indent }}|{{ 'a\\nb'|indent(2, true) }}|{{ 'a\\n\\nb'|indent('> ', blank=true) }}|{{ ''|indent }}|",
      "{{ d|tojson }} {{ l|tojson }} {{ s|tojson }} {{ 'é\"\\\\\\n\\t\\x01'|tojson }} {{ n|tojson }} {{ t|tojson }} {{ f|tojson }} {{ big|tojson }}",
      "{{ nested|tojson(indent=2) }} {{ d|tojson(sort_keys=true) }} {{ d|tojson(separators=(',', ':')) }} {{ l|tojson(indent='\\t') }} {{ empty|tojson(indent=2) }}",
      "{{ 'é😀'|tojson(ensure_ascii=true) }} {{ {1: 'a', none: 'b', true: 'c', 2.5: 'd'}|tojson }} {{ (1, 2)|tojson }} {{ {}|tojson(indent=0) }} {{ [[]]|tojson(indent=0) }}",
      // String methods.
      "[{{ '  a b  '.strip() }}] [{{ 'xxaxx'.strip('x') }}] [{{ '  a'.lstrip() }}] [{{ 'a  '.rstrip() }}] [{{ '\\n\\nx'.lstrip('\\n') }}]",
      "{{ 'a,b,,c'.split(',') }} {{ ' a  b '.split() }} {{ 'a b c'.split(' ', 1) }} {{ 'a b c'.rsplit(' ', 1) }} {{ 'x</think>y'.split('</think>')[-1] }} {{ 'l1\\nl2\\r\\nl3'.splitlines() }}",
      "{{ s.startswith('hé') }} {{ s.endswith('ld') }} {{ s.startswith(('x', 'h')) }} {{ 'aXa'.replace('a', 'b') }} {{ 'abc'.upper() }} {{ 'ABC'.lower() }} {{ 'ab cd'.title() }} {{ 'aB'.capitalize() }}",
      "{{ s.find('l') }} {{ s.rfind('l') }} {{ s.find('z') }} {{ s.count('l') }} {{ '-'.join(['a', 'b']) }} {{ '12'.isdigit() }} {{ 'ab'.isalpha() }} {{ '  '.isspace() }} {{ 'ab'.islower() }}",
      "{{ 'Hello {}, {name}!'.format('you', name='me') }} {{ '{0}{0}'.format('x') }} {{ 'pre-x'.removeprefix('pre-') }} {{ 'x.txt'.removesuffix('.txt') }}",
      "{{ s.nope }}|{{ l.append }}|{{ d.update }}|{{ l.index(2) }} {{ l.count(1) }} {{ s.upper is defined }}",
      // Statements: for and loop, if/elif/else, set, namespace, macro, break/continue, with, filter, set blocks.
      "{% for x in l %}{{ loop.index }}{{ loop.index0 }}{{ loop.revindex }}{{ loop.revindex0 }}{{ loop.first }}{{ loop.last }}{{ loop.length }};{% endfor %}",
      "{% for x in l %}{{ loop.previtem }}<{{ x }}>{{ loop.nextitem }}|{{ loop.cycle('a', 'b') }}{{ loop.changed(x > 1) }} {% endfor %}",
      "{% for x in l if x > 1 %}{{ x }}:{{ loop.index }}/{{ loop.length }} {% else %}none{% endfor %}{% for x in [] %}x{% else %}empty{% endfor %}",
      "{% for k in d %}{{ k }},{% endfor %} {% for c in 'ab' %}{{ c }}.{% endfor %} {% for a, b in [(1, 2), (3, 4)] %}{{ a + b }}{% endfor %} {% for m in messages %}{% for k, v in m.items() %}{{ k }}{% endfor %};{% endfor %}",
      "{% for x in l %}{% if x == 1 %}{% continue %}{% endif %}{% if x == 2 %}{% break %}{% endif %}{{ x }}{% endfor %}",
      "{% for i in range(3) %}{% for j in range(i) %}{{ i }}{{ j }}{{ loop.index }} {% endfor %}{{ loop.index }}|{% endfor %}",
      "{{ range(3)|list }} {{ range(1, 10, 3)|list }} {{ range(5, 0, -2)|list }} {{ range(3) }} {{ range(0, 10, 2) }} {{ range(3)|length }} {{ range(10)[2:5] }}",
      "{% if i > 10 %}big{% elif i > 5 %}medium{% elif i > 0 %}small{% else %}none{% endif %} {% if l %}list{% endif %}{% if empty %}never{% endif %}",
      "{% set x = 0 %}{% for i in range(3) %}{{ x }}{% set x = x + 1 %}{{ x }};{% endfor %}{{ x }}",
      "{% for i in range(3) %}{% if i == 1 %}{% set y = 5 %}{% endif %}{{ y }};{% endfor %}[{{ y }}]",
      "{% set ns = namespace(total=0, names=[]) %}{% for p in people %}{% set ns.total = ns.total + p.age|default(0) %}{% set ns.names = ns.names + [p.name] %}{% endfor %}{{ ns.total }} {{ ns.names }} {{ ns.missing }}",
      "{% set ns = namespace({'a': 1}, b=2) %}{{ ns.a }}{{ ns.b }} {% set a, b = 1, 2 %}{{ a }}{{ b }} {% set t = 1, 2 %}{{ t }} {% set messages = messages[1:] %}{{ messages|length }}",
      "{% macro greet(name, greeting='Hello', punct=none) %}{{ greeting }}, {{ name }}{{ punct or '!' }}{% endmacro %}{{ greet('A') }} {{ greet('B', 'Hi') }} {{ greet(name='C', punct='?') }} {{ greet() }}",
      "{% macro m() %}{{ x }}{% endmacro %}{% set x = 2 %}{{ m() }}{% for x in [7] %}{{ m() }}{% endfor %}",
      "{% macro fact(n) %}{% if n <= 1 %}1{% else %}{{ n * fact(n - 1)|int }}{% endif %}{% endmacro %}{{ fact(6) }} {{ fact(6)|length }} {{ fact is callable }}",
      "{% macro t(x) %}[{{ x }}]{% endmacro %}{% set s2 = t('a') + t('b') %}{{ s2 }} {{ t('q')|length }}",
      "{% with a = 1, b = l %}{{ a }}{{ b }}{% set c = 3 %}{% endwith %}{{ a }}{{ c }}",
      // Call blocks and caller(), *args and **kwargs.
      "{% macro box(title) %}[{{ title }}: {{ caller() }}]{% endmacro %}{% call box('t') %}inside {{ i }}{% endcall %}",
      "{% macro each(xs) %}{% for x in xs %}{{ caller(x, loop.index) }}{% endfor %}{% endmacro %}{% call(item, n) each(l) %}{{ n }}={{ item }};{% endcall %}",
      "{% macro m(a) %}{{ caller is defined }}{{ a }}{% endmacro %}{{ m(1) }}{% macro plain() %}p{% endmacro %}{% call plain() %}x{% endcall %}",
      "{% macro add(a, b, c=3) %}{{ a + b + c }}{% endmacro %}{{ add(*[1, 2]) }} {{ add(1, **{'b': 5}) }} {{ add(*l) }} {{ add(**{'a': 1, 'b': 1, 'c': 1}) }} {{ dict(**d) }}",
      "{% macro f(a) %}{{ a }}{% endmacro %}{{ f(*missing) }}|{{ f(**n) }}",
      "{% filter upper %}shout {{ s }}{% endfilter %} {% set block %}captured {{ i }}{% endset %}[{{ block }}] {% set b2 | trim %}  padded  {% endset %}[{{ b2 }}]",
      "{% for m in messages %}{% generation %}{{ m.role }}{% set inner = 1 %}{% endgeneration %}{{ inner }}{% endfor %}",
      "{{ dict(a=1, b='x') }} {{ dict([('k', 'v')]) }} {{ dict(d, c=3) }} {{ {'a': 1, 'a': 2} }} {{ strftime_now('%Y-%m-%d %H:%M:%S %b %A') }}",
      // raise_exception and runtime errors (both sides refuse).
      "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}",
      "{% if messages[0].role == 'system' %}{{ raise_exception('System role not supported: ' ~ messages[0].content) }}{% endif %}",
      "{{ missing.attr }}", "{{ missing[0] }}", "{{ missing + 1 }}", "{{ 1 + 'a' }}", "{{ 1 / 0 }}", "{{ 1 // 0 }}", "{{ none + 1 }}",
      "{{ l < 'a' }}", "{{ 3 in 'abc' }}", "{{ d|tojson(sort_keys=true) if false else missing|tojson }}", "{{ range(200000)|length }}",
      "{% for a, b in [(1, 2, 3)] %}{% endfor %}", "{% set x = 1 %}{% set x.y = 2 %}", "{{ l.append(4) }}", "{{ 'a'.nope() }}",
      "{{ [1, 2]|last }} {{ (l|select)|last }}", "{{ l|selectattr('x')|length }}", "{{ {'a': 1}['a'].b.c }}", "{{ d.items()[0] }}",
      // jinja2's generator filters run only as far as they are read; falsy input gives nothing.
      "{% set g = i|map(attribute='x') %}{{ 'unread' if g else 'never' }} {{ n|map('upper')|list }} {{ e|select|list }} {{ missing|items|list }}",
      "{{ [messages[0], 7]|map(attribute='role.x')|first }}", "{{ [messages[0], 7]|map(attribute='role.x')|list }}",
      "{{ i|selectattr('x')|list }}", "{% if i|map('upper') %}truthy{% endif %}{{ (l|unique)|first }} {{ [[1], 2]|unique|first }}",
      // An unknown filter or test inside an if (jinja2's soft frames) fails only when reached.
      "{% if false %}{{ x|nosuchfilter }}{% endif %}{{ 'x' if true else y|nosuchfilter }}{% if false %}{{ x is nosuchtest }}{% endif %}ok",
      "{% if true %}{{ x|nosuchfilter }}{% endif %}", "{% if false %}{{ x|truncate(3) }}{% endif %}fine",
      // Odd corners found by random templates against jinja2.
      "{{ d|indent }}", "{{ missing|indent }}", "{{ missing|int }}", "{{ missing|float }}", "{{ missing is callable }}",
      "{{ (1,) in d }} {{ missing in d }} {{ {(1, 'a'): 'tuple key'} }} {{ -2 * (1,) }} {{ [messages[-1].role|safe, 'x'] }}",
      "{{ (not 'ab' is mapping)[:2] }}|{{ [2.5, (1e3 is integer)[:2]] }}", "{% for x in 3.0[:2] %}{% endfor %}",
  };
  std::vector<std::pair<std::string, std::string>> cases;
  for (const auto& t : templates) cases.emplace_back(t, v);
  expect_same(cases);
}

// The conversations of conversations.jsonl rendered through every fixture folder, with and
// without the generation prompt: as `jinja_reference.py chat` renders them.
TEST(ChatTemplate, RealTemplatesRenderAsTransformers) {
  std::vector<std::string> conversations;
  {
    std::istringstream in(read_file(kDir / "conversations.jsonl"));
    for (std::string line; std::getline(in, line);)
      if (!line.empty()) conversations.push_back(line);
  }
  int folders = 0, rendered = 0;
  for (const auto& entry : fs::directory_iterator(kDir / "models")) {
    if (!entry.is_directory()) continue;
    ++folders;
    const ChatTemplate chat = ChatTemplate::load(entry.path());
    for (const bool prompt : {false, true}) {
      const auto [code, out] =
          run(kReference + " chat '" + entry.path().string() + "' '" + (kDir / "conversations.jsonl").string() + "' --now " +
              kNow + (prompt ? " --add-generation-prompt" : ""));
      ASSERT_EQ(code, 0) << out;
      const auto reference = lines_of(out);
      ASSERT_EQ(reference.size(), conversations.size());
      int ok_here = 0;
      for (std::size_t i = 0; i < conversations.size(); ++i) {
        SCOPED_TRACE(entry.path().filename().string() + ", conversation " + std::to_string(i + 1) +
                     (prompt ? ", add_generation_prompt" : ""));
        Outcome ours;
        try {
          ours.text = chat.apply(conversations[i], prompt, fixed_time());
          ours.ok = true;
        } catch (const TemplateError& e) {
          ours.raised = e.kind() == TemplateError::Kind::raised;
          ours.text = ours.raised ? e.message() : e.what();
        }
        const bool theirs_ok = reference[i].is_string();
        EXPECT_EQ(ours.ok, theirs_ok) << "Tessera: " << ours.text << "\njinja2: " << reference[i].dump();
        if (ours.ok && theirs_ok) EXPECT_EQ(ours.text, reference[i].get<std::string>());
        if (!theirs_ok && reference[i]["raised"].get<bool>())
          EXPECT_EQ("TemplateError: " + ours.text, reference[i]["error"].get<std::string>());
        ok_here += ours.ok && theirs_ok;
      }
      EXPECT_GE(ok_here, 1) << entry.path() << " rendered no conversation: the comparison would be empty";
      rendered += ok_here;
    }
  }
  EXPECT_GE(folders, 20);
  EXPECT_GE(rendered, 250);
}

// `tessera tokenizer chat` prints what transformers' apply_chat_template renders, one JSON
// string per line, for folders on which every conversation renders.
TEST(ChatTemplate, CommandPrintsEachConversationRendered) {
  // Tools and tool calls, strftime_now, {% generation %}, AddedToken objects in the config.
  for (const char* folder : {"qwen2.5-7b-instruct", "llama-3.2-11b-vision-instruct", "smollm3-3b", "deepseek-r1"}) {
    SCOPED_TRACE(folder);
    const fs::path dir = kDir / "models" / folder;
    fs::path input = scratch(folder) / "conversations.jsonl";
    {
      // The conversations the reference renders without failing.
      const auto [code, out] = run(kReference + " chat '" + dir.string() + "' '" + (kDir / "conversations.jsonl").string() + "'");
      ASSERT_EQ(code, 0);
      const auto rendered = lines_of(out);
      std::istringstream in(read_file(kDir / "conversations.jsonl"));
      std::ofstream keep(input);
      std::size_t i = 0;
      for (std::string line; std::getline(in, line); ++i)
        if (i < rendered.size() && rendered[i].is_string()) keep << line << "\n";
    }
    for (const std::string flag : {"", " --add-generation-prompt"}) {
      const std::string tail = std::string(" --now ") + kNow + flag;
      const auto theirs = run(kReference + " chat '" + dir.string() + "' '" + input.string() + "'" + tail);
      const auto ours = run(std::string("'") + TESSERA_BINARY + "' tokenizer chat --tokenizer '" + dir.string() + "' --input '" +
                            input.string() + "'" + tail);
      ASSERT_EQ(ours.first, 0) << ours.second;
      EXPECT_EQ(ours.second, theirs.second);
      EXPECT_GE(lines_of(ours.second).size(), 5u);
    }
  }
}

// One parsed template, rendered by several threads at once, renders as it does alone.
TEST(ChatTemplate, RendersOnManyThreadsAtOnce) {
  const ChatTemplate chat = ChatTemplate::load(kDir / "models" / "qwen3");
  std::vector<std::string> conversations;
  std::istringstream in(read_file(kDir / "conversations.jsonl"));
  std::size_t index = 0;
  for (std::string line; std::getline(in, line); ++index)
    if (index != 3 && index != 8) conversations.push_back(line);  // those two qwen3 refuses
  std::vector<std::string> alone;
  for (const auto& c : conversations) alone.push_back(chat.apply(c, true));
  std::vector<std::thread> threads;
  std::atomic<int> differing{0};
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([&, t] {
      for (int i = 0; i < 50; ++i) {
        const std::size_t k = static_cast<std::size_t>(t + i) % conversations.size();
        differing += chat.apply(conversations[k], true) != alone[k];
      }
    });
  for (auto& thread : threads) thread.join();
  EXPECT_EQ(differing.load(), 0);
}

TemplateError error_of(const std::string& source, const std::string& variables = "{}",
                       const RenderOptions& options = RenderOptions{}) {
  try {
    JinjaTemplate(source, "t.jinja").render(variables, options);
  } catch (const TemplateError& e) {
    return e;
  }
  ADD_FAILURE() << "no TemplateError from " << source;
  return TemplateError(TemplateError::Kind::runtime, "none", 0, 0, "none");
}

TEST(ChatTemplate, ConstructsOutsideTheSubsetAreRefusedByLineAndColumn) {
  struct Case {
    const char* source;
    int line, column;
    const char* says;
  };
  const std::vector<Case> cases = {
      {"ok\n{% include 'other.jinja' %}", 2, 4, "the 'include' tag is not supported"},
      {"{% extends 'base' %}", 1, 4, "the 'extends' tag is not supported"},
      {"a\nb\n  {{ x | truncate(3) }}", 3, 10, "the filter 'truncate' is not supported"},
      {"{{ x | wordwrap }}", 1, 8, "the filter 'wordwrap' is not supported"},
      {"{% for x in xs recursive %}{% endfor %}", 1, 16, "a recursive for loop is not supported"},
      {"{% block b %}{% endblock %}", 1, 4, "the 'block' tag is not supported"},
      {"\n\n{{ cycler('a') }}", 3, 4, "the name 'cycler' is not supported"},
      {"{{ 'abc'.zfill(5) }}", 1, 9, "the str method 'zfill' is not supported"},
      {"{{ '%s' % 'x' }}", 1, 9, "string formatting with '%' is not supported"},
      {"{{ 2 ** 70 }}", 1, 6, "an integer beyond 64 bits is not supported"},
      {"{{ 123456789012345678901234567890 }}", 1, 4, "beyond 64 bits"},
  };
  for (const auto& c : cases) {
    const TemplateError e = error_of(c.source, R"({"x": "abcdef", "xs": []})");
    EXPECT_EQ(e.kind(), TemplateError::Kind::unsupported) << c.source << ": " << e.what();
    EXPECT_EQ(e.line(), c.line) << c.source << ": " << e.what();
    EXPECT_EQ(e.column(), c.column) << c.source << ": " << e.what();
    EXPECT_NE(std::string(e.what()).find(c.says), std::string::npos) << e.what();
    EXPECT_EQ(std::string(e.what()).rfind("t.jinja:" + std::to_string(c.line) + ":" + std::to_string(c.column) + ": ", 0), 0u)
        << e.what();
  }
}

TEST(ChatTemplate, SyntaxErrorsNameTheirPlace) {
  struct Case {
    const char* source;
    int line;
    const char* says;
  };
  const std::vector<Case> cases = {
      {"{% if x %}\nno end", 2, "Jinja was looking for the following tags: 'elif' or 'else' or 'endif'"},
      {"{% for x in y %}{% endif %}", 1, "Encountered unknown tag 'endif'. Jinja was looking for the following tags: 'endfor' or 'else'."},
      {"{{ x | nosuchfilter }}", 1, "No filter named 'nosuchfilter'"},
      {"{{ x is nosuchtest }}", 1, "No test named 'nosuchtest'"},
      {"a\n{% do x.append(1) %}", 2, "Encountered unknown tag 'do'"},
      {"{{ (1 + 2 }}", 1, "expected ')'"},
      {"{{ 'unterminated }}", 1, "unterminated string"},
      {"{# never closed", 1, "Missing end of comment tag"},
      {"{% break %}", 1, "'break' outside of a loop"},
      {"\n\n  {{ 1 ! 2 }}", 3, "unexpected char '!'"},
      {"{% macro m(a=1, b) %}{% endmacro %}", 1, "non-default argument follows default argument"},
  };
  for (const auto& c : cases) {
    const TemplateError e = error_of(c.source);
    EXPECT_EQ(e.kind(), TemplateError::Kind::syntax) << c.source << ": " << e.what();
    EXPECT_EQ(e.line(), c.line) << c.source << ": " << e.what();
    EXPECT_NE(std::string(e.what()).find(c.says), std::string::npos) << c.source << ": " << e.what();
  }
  // Errors while rendering name the expression's place too.
  const TemplateError e = error_of("line one\n{% for m in messages %}{{ m.content + 1 }}{% endfor %}",
                                   R"({"messages": [{"content": "text"}]})");
  EXPECT_EQ(e.kind(), TemplateError::Kind::runtime);
  EXPECT_EQ(e.line(), 2);
  EXPECT_NE(std::string(e.what()).find("t.jinja:2:"), std::string::npos) << e.what();
  const TemplateError raised = error_of("\n  {{ raise_exception('Only user and assistant roles are supported!') }}");
  EXPECT_EQ(raised.kind(), TemplateError::Kind::raised);
  EXPECT_EQ(raised.message(), "Only user and assistant roles are supported!");
  EXPECT_EQ(raised.line(), 2);
}

TEST(ChatTemplate, TheRenderBudgetRefusesHostileTemplates) {
  const auto budget = [](const std::string& source, const RenderOptions& options = RenderOptions{}) {
    const auto start = std::chrono::steady_clock::now();
    const TemplateError e = error_of(source, "{}", options);
    EXPECT_EQ(e.kind(), TemplateError::Kind::budget) << source.substr(0, 80) << ": " << e.what();
    EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10) * kSanitizerSlowdown) << source.substr(0, 80);
    return std::string(e.what());
  };
  // Loops whose product is astronomical, in steps.
  EXPECT_NE(budget("{% for a in range(100000) %}{% for b in range(100000) %}{{ a }}{% endfor %}{% endfor %}").find("steps"),
            std::string::npos);
  // Output (and any one string) doubling without bound.
  EXPECT_NE(budget("{% set ns = namespace(s='x') %}{% for i in range(100) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}").find("bytes"),
            std::string::npos);
  budget("{{ 'x' * 1000000000 }}");
  budget("{% for i in range(100000) %}{{ 'y' * 1000 }}{% endfor %}");
  // Recursion without end ("nested": the count runs out, or "nests": the stack does first, where
  // frames are larger, as under AddressSanitizer), and recursion inside deep expressions (the stack).
  EXPECT_NE(budget("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}").find("nest"), std::string::npos);
  EXPECT_NE(budget("{% macro f(n) %}{{ " + std::string(90, '[') + "f(n + 1)" + std::string(90, ']') +
                   " }}{% endmacro %}{{ f(0) }}")
                .find("stack"),
            std::string::npos);
  // Nesting deeper than the parser allows: parentheses, blocks, long chains.
  budget("{{ " + std::string(5000, '(') + "1" + std::string(5000, ')') + " }}");
  std::string blocks;
  for (int i = 0; i < 3000; ++i) blocks += "{% if true %}";
  budget(blocks);
  std::string chain = "{{ 1";
  for (int i = 0; i < 5000; ++i) chain += " + 1";
  budget(chain + " }}");
  // Values nested too deep to walk.
  const TemplateError deep = error_of("{% set ns = namespace(v=[]) %}{% for i in range(2000) %}{% set ns.v = [ns.v] %}{% endfor %}{{ ns.v }}");
  EXPECT_NE(std::string(deep.what()).find("nested more than"), std::string::npos) << deep.what();
  // A tighter budget applies as given.
  RenderOptions tight;
  tight.limits.max_steps = 1000;
  budget("{% for i in range(2000) %}{{ i }}{% endfor %}", tight);
}

TEST(ChatTemplate, FoldersFollowTransformersLoading) {
  const auto conversation = R"({"messages": [{"role": "user", "content": "hi"}]})";
  const std::string echo = "{{ bos_token }}|{{ eos_token }}|{{ pad_token }}|{{ unk_token }}|{{ additional_special_tokens }}|{{ tools }}|{{ documents }}|{{ add_generation_prompt }}";
  // A string template, AddedToken objects, special_tokens_map.json winning, empty tokens left out.
  {
    const json config = {{"bos_token", {{"__type", "AddedToken"}, {"content", "<s>"}}}, {"eos_token", "</s>"},
                         {"pad_token", ""}, {"unk_token", nullptr}, {"chat_template", echo},
                         {"additional_special_tokens", {"<a>", {{"content", "<b>"}}}}};
    const json map = {{"eos_token", {{"content", "<|end|>"}}}};
    const auto t = ChatTemplate::from_files({{"tokenizer_config.json", config.dump()}, {"special_tokens_map.json", map.dump()}}, "dir");
    EXPECT_EQ(t.apply(conversation, true), "<s>|<|end|>|||['<a>', '<b>']|None|None|True");
    EXPECT_EQ(t.apply(R"({"messages": [], "tools": [], "documents": [{"title": "t"}], "bos_token": "kw"})", false),
              "kw|<|end|>|||['<a>', '<b>']|[]|[{'title': 't'}]|False");
  }
  // A list of named templates: tool_use when there are tools, else default; chat_template.jinja
  // and additional_chat_templates/ win over the config's.
  {
    const json config = {{"chat_template", {{{"name", "default"}, {"template", "D"}}, {{"name", "tool_use"}, {"template", "T"}}}}};
    const auto t = ChatTemplate::from_files({{"tokenizer_config.json", config.dump()}}, "dir");
    EXPECT_EQ(t.apply(conversation, false), "D");
    EXPECT_EQ(t.apply(R"({"messages": [], "tools": [{"type": "function"}]})", false), "T");
    EXPECT_EQ(t.apply(R"({"messages": [], "tools": null})", false), "D");
    const auto files = ChatTemplate::from_files(
        {{"tokenizer_config.json", config.dump()}, {"chat_template.jinja", "J\n"}, {"additional_chat_templates/tool_use.jinja", "U"}}, "dir");
    EXPECT_EQ(files.apply(conversation, false), "J");
    EXPECT_EQ(files.apply(R"({"messages": [], "tools": []})", false), "U");
  }
  // What is refused, naming the file.
  const auto refusal = [](const std::map<std::string, std::string>& files, const std::string& conversation = "{\"messages\": []}") {
    try {
      ChatTemplate::from_files(files, "dir").apply(conversation, false);
    } catch (const tessera::sdk::Error& e) {
      return std::string(e.what());
    }
    return std::string("<no error>");
  };
  EXPECT_NE(refusal({{"tokenizer_config.json", "{}"}}).find("dir has no chat template"), std::string::npos);
  EXPECT_NE(refusal({{"tokenizer_config.json", "{"}}).find("dir/tokenizer_config.json is not valid JSON"), std::string::npos);
  EXPECT_NE(refusal({{"tokenizer_config.json", R"({"chat_template": 3})"}}).find("dir/tokenizer_config.json"), std::string::npos);
  EXPECT_NE(refusal({{"tokenizer_config.json", R"({"chat_template": "{% if %}"})"}}).find("dir/tokenizer_config.json (chat_template):1:"),
            std::string::npos);
  EXPECT_NE(refusal({{"tokenizer_config.json", R"({"chat_template": [{"name": "rag", "template": "x"}]})"}}).find("no default chat template"),
            std::string::npos);
  EXPECT_NE(refusal({{"chat_template.jinja", "x"}}, R"({"content": "no messages"})").find("needs \"messages\""), std::string::npos);
  EXPECT_NE(refusal({{"chat_template.jinja", "x"}}, "[1]").find("a conversation is a JSON object"), std::string::npos);
}

TEST(ChatTemplate, CommandRefusesBadInputByFileAndLine) {
  const fs::path dir = scratch("command");
  std::ofstream(dir / "tokenizer_config.json") << json{{"chat_template", "{{ messages[0].content }}\n{{ 1 + messages[1].content }}"}}.dump();
  std::ofstream(dir / "good.jsonl") << R"({"messages": [{"content": "a"}, {"content": 1}]})" << "\n\n"
                                    << R"({"messages": [{"content": "é\n"}, {"content": 2}]})" << "\n";
  std::ofstream(dir / "bad.jsonl") << R"({"messages": [{"content": "a"}, {"content": 1}]})" << "\n"
                                   << R"({"messages": [{"content": "a"}, {"content": "b"}]})" << "\n";
  const std::string tessera = std::string("'") + TESSERA_BINARY + "' tokenizer chat --tokenizer '" + dir.string() + "' --input ";
  const auto good = run(tessera + "'" + (dir / "good.jsonl").string() + "' 2>&1");
  EXPECT_EQ(good.first, 0) << good.second;
  EXPECT_EQ(good.second, "\"a\\n2\"\n\"é\\n\\n3\"\n");
  const auto bad = run(tessera + "'" + (dir / "bad.jsonl").string() + "' 2>&1");
  EXPECT_EQ(bad.first, 1);
  EXPECT_NE(bad.second.find("bad.jsonl:2: "), std::string::npos) << bad.second;
  EXPECT_NE(bad.second.find("tokenizer_config.json (chat_template):2:"), std::string::npos) << bad.second;
  const auto usage = run(std::string("'") + TESSERA_BINARY + "' tokenizer chat --input x 2>&1");
  EXPECT_EQ(usage.first, 2) << usage.second;
  EXPECT_NE(usage.second.find("chat needs --tokenizer"), std::string::npos) << usage.second;
}

}  // namespace
