// The .dat container and q4dat tool tests name the support library's ScopedTempDir (a fresh
// folder per test, removed with its files) in their own namespace.
#pragma once

#include "q4/test/temp_dir.h"

namespace q4::model::test {

using q4::test::ScopedTempDir;

}  // namespace q4::model::test
