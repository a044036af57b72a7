// Tokenizer throughput: loads the real Qwen3 tokenizer.json, builds a deterministic ~8 MB
// mixed-language corpus (English pseudo-prose with a long tail of words, Chinese, Japanese,
// Korean, Russian, code, emoji, and the golden fixture texts) and reports encode MB/s on one
// thread with a cold and a warm per-word cache (the cold pass is the baseline for the cache's
// gain), plus load time. Paths default to the source tree this file was built from. Usage:
//   bench_data [tokenizer.json] [--dump corpus.jsonl]   (dump: one JSON string per line)
#include <c10/util/Exception.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "q4/data/tokenizer.h"

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

std::string cpu_name() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("model name", 0) == 0) return line.substr(line.find(':') + 2);
  }
  return "unknown CPU";
}

struct Lcg {
  uint64_t s;
  uint32_t next() {
    s = s * 6364136223846793005ULL + 1442695040888963407ULL;
    return static_cast<uint32_t>(s >> 33);
  }
  uint32_t below(uint32_t n) { return next() % n; }
};

void append_utf8(std::string* out, uint32_t cp) {
  if (cp < 0x80) {
    *out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    *out += static_cast<char>(0xC0 | (cp >> 6));
    *out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    *out += static_cast<char>(0xE0 | (cp >> 12));
    *out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    *out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    *out += static_cast<char>(0xF0 | (cp >> 18));
    *out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    *out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    *out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

// One line of the corpus (a "document"); roughly 40% English, 25% CJK, 35% other.
std::string make_line(Lcg& r, const std::vector<std::string>& golden) {
  static const char* kSyll[] = {"ta", "re", "ion", "st",  "en", "qu",   "ph", "ar", "ing", "ed",
                                "th", "ou", "com", "pre", "ly", "ment", "ex", "al", "er",  "ca"};
  static const char* kWords[] = {"the",  "of",   "and",  "to",      "in",
                                 "is",   "that", "for",  "model",   "training",
                                 "data", "we",   "It's", "they're", "I'll"};
  static const char* kCode[] = {
      "for (int i = 0; i < n; ++i) {\n    sum += x[i] * w[i];\n}\n",
      "def forward(self, x):\n    return self.proj(F.silu(self.gate(x)) * self.up(x))\n",
      "    if err != nil {\n\t\treturn fmt.Errorf(\"open %s: %w\", path, err)\n\t}\n",
      "SELECT id, name FROM users WHERE created_at > '2024-01-01' ORDER BY id;\n",
      "<div class=\"row\"><span>{{ item.title }}</span></div>\n"};
  std::string s;
  const uint32_t kind = r.below(20);
  const int n = 20 + static_cast<int>(r.below(120));
  if (kind < 8) {  // English with a long tail of made-up words and numbers
    for (int i = 0; i < n; ++i) {
      if (r.below(3) == 0) {
        std::string w;
        for (uint32_t k = 0, m = 1 + r.below(4); k < m; ++k) w += kSyll[r.below(20)];
        if (r.below(8) == 0) w[0] = static_cast<char>(w[0] - 32);
        s += w;
      } else {
        s += kWords[r.below(15)];
      }
      s += r.below(12) == 0 ? ", " : r.below(15) == 0 ? ". " : r.below(40) == 0 ? " 3.14 " : " ";
    }
  } else if (kind < 13) {  // CJK: common Chinese range plus kana and hangul
    for (int i = 0; i < n; ++i) {
      const uint32_t pick = r.below(10);
      if (pick < 7) {
        append_utf8(&s, 0x4E00 + r.below(0x51A5));
      } else if (pick < 8) {
        append_utf8(&s, 0x3041 + r.below(0x56));
      } else if (pick < 9) {
        append_utf8(&s, 0xAC00 + r.below(0x2BA4));
      } else {
        s += r.below(2) ? "\xEF\xBC\x8C" : "\xE3\x80\x82";  // ，。
      }
    }
  } else if (kind < 15) {  // Russian-like words
    for (int i = 0; i < n / 2; ++i) {
      for (uint32_t k = 0, m = 2 + r.below(8); k < m; ++k) append_utf8(&s, 0x430 + r.below(32));
      s += ' ';
    }
  } else if (kind < 18) {
    for (int i = 0; i < 1 + n / 40; ++i) s += kCode[r.below(5)];
  } else if (kind < 19) {
    for (int i = 0; i < n / 4; ++i) {
      append_utf8(&s, 0x1F600 + r.below(0x50));
      s += ' ';
    }
  } else {
    s += golden[r.below(static_cast<uint32_t>(golden.size()))];
  }
  return s;
}

}  // namespace

// Repository root, from this file's path (scripts/bench/bench_data.cpp).
std::string source_root() {
  std::string f = __FILE__;
  for (int k = 0; k < 3; ++k) f = f.substr(0, f.find_last_of('/'));
  return f;
}

int main(int argc, char** argv) {
  std::string path = source_root() + "/assets/qwen3/tokenizer.json";
  std::string dump;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--dump" && i + 1 < argc) {
      dump = argv[++i];
    } else {
      path = a;
    }
  }
  try {
    const std::string device = cpu_name();
    auto t0 = Clock::now();
    auto tok = q4::data::Tokenizer::from_file(path);
    const double load_s = seconds_since(t0);

    std::vector<std::string> golden;
    {
      std::ifstream in(source_root() + "/tests/fixtures/tokenizer_golden.json");
      if (in) {
        for (const auto& c : nlohmann::json::parse(in)) golden.push_back(c["text"]);
      }
      if (golden.empty()) golden.push_back("Hello, world!");
    }
    Lcg r{42};
    std::vector<std::string> lines;
    size_t bytes = 0;
    while (bytes < (8u << 20)) {
      lines.push_back(make_line(r, golden));
      bytes += lines.back().size();
    }
    if (!dump.empty()) {
      std::ofstream out(dump);
      for (const auto& l : lines) out << nlohmann::json(l).dump() << '\n';
    }
    const double mb = static_cast<double>(bytes) / 1e6;

    size_t tokens = 0;
    t0 = Clock::now();
    for (const auto& l : lines) tokens += tok.encode(l).size();
    const double cold_s = seconds_since(t0);
    t0 = Clock::now();
    for (const auto& l : lines) tokens += tok.encode(l).size();
    const double warm_s = seconds_since(t0);
    tokens /= 2;

    std::printf("device: %s (1 thread)\n", device.c_str());
    std::printf("tokenizer load: %.3f s (%s)\n", load_s, path.c_str());
    std::printf("corpus: %.2f MB, %zu lines, %zu tokens (%.2f bytes/token)\n", mb, lines.size(),
                tokens, static_cast<double>(bytes) / static_cast<double>(tokens));
    std::printf("encode cold cache: %.2f MB/s (%.0f tokens/s)\n", mb / cold_s,
                static_cast<double>(tokens) / cold_s);
    std::printf("encode warm cache: %.2f MB/s (%.0f tokens/s)\n", mb / warm_s,
                static_cast<double>(tokens) / warm_s);
    std::printf("warm / cold speed: %.2fx\n", cold_s / warm_s);
  } catch (const c10::Error& e) {
    std::cerr << "bench_data: " << e.what_without_backtrace() << '\n';
    return 2;
  }
  return 0;
}
