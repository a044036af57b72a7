// The rule every q4 program applies before it writes (docs/reliability.md#inputs-and-outputs): an
// output path never is, holds or lies inside a file or folder the program reads, and an output
// file's path can be written (its directory exists and is writable; the path itself is new or a
// regular file). Paths are compared resolved (absolute, normalized, symbolic links followed),
// and two existing paths that are one file through a hard link count as the same.
#pragma once

#include <string>

namespace q4::io {

// How `output` relates to `input`: "is" (the same path or the same file), "holds" (`input` lies
// under the folder `output`), "lies inside" (`output` lies under the folder `input`), or ""
// when they are apart. Empty paths are apart from everything.
std::string output_input_relation(const std::string& output, const std::string& input);

// Why a regular file cannot be published at `path` (by AtomicFile: a temp file beside it, then a
// rename): "" when it can; otherwise a phrase to follow the path in a message ("is a directory",
// "is a FIFO", "is a symbolic link to a character device", "is in a directory that does not
// exist (/x/y)", "is in a directory that is not writable (/x)").
std::string output_file_problem(const std::string& path);

}  // namespace q4::io
