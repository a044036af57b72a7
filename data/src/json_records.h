// Reading a data file record by record (internal to q4_data): the SFT and preference loaders
// (dataset.cpp) and the prompt loader (prompt_dataset.cpp) share it, and the rule for a bad
// record, so every loader names the line where a bad record starts and skips it alike.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "q4/data/dataset.h"

namespace q4::data::json_records {

// A malformed line or record: its reason, turned into an error or a skip by the loader.
struct BadRecord {
  std::string reason;
};

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

// A malformed line or record: an error naming the file and line, or (on_error: skip) counted and
// reported in the summary. `unit` names what is skipped ("lines", "records").
void skip_or_fail(LoadSummary* s, const DatasetOptions& options, const std::string& name,
                  int64_t line, const std::string& reason, const char* unit);

// The frame of a loader that takes a file one record at a time (preference pairs, prompts):
// checks options.system_prompt, sets summary->path to `name` and calls take(text, line) for each
// record (for_each_record); a record whose take throws BadRecord is skipped or an error
// (skip_or_fail, "records"). The caller sets summary->examples.
void load_records(const std::string& content, const std::string& name,
                  const DatasetOptions& options, LoadSummary* summary,
                  const std::function<void(const std::string&, int64_t)>& take);

// The whole of a data file (binary: line ends are the loaders' to split); errors name `path`.
std::string read_data_file(const std::string& path);

}  // namespace q4::data::json_records
