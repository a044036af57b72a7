// Reading a JSON-array data file record by record (internal to q4_data): the SFT and preference
// loaders (dataset.cpp) and the prompt loader (prompt_dataset.cpp) share it, so every loader
// names the line where a bad record starts.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "q4/data/dataset.h"

namespace q4::data::json_records {

// A record of a JSON-array file: the text of one top-level element and its first line.
struct ArrayRecord {
  std::string text;
  int64_t line = 0;
};

// Line ends ("\n", "\r\n" or a lone "\r", as the line reader splits) in content[0, end).
int64_t count_line_ends(const std::string& content, size_t end);

// The top-level elements of `content` (a JSON array starting at byte `pos`), each with the
// 1-based line where it starts; invalid JSON throws "<name>:<line>: ..." naming the line of the
// error. Elements are re-parsed one by one, so a bad record is an error (or a skip) of its own.
std::vector<ArrayRecord> split_json_array(const std::string& content, size_t pos,
                                          const std::string& name);

// Calls take(text, line) for each record of a whole file's `content`: the elements of a JSON
// array, else one JSON object a line (a UTF-8 BOM skipped; blank lines counted in
// summary->ignored). Sets summary->json_array and summary->lines.
void for_each_record(const std::string& content, const std::string& name, LoadSummary* summary,
                     const std::function<void(const std::string&, int64_t)>& take);

}  // namespace q4::data::json_records
