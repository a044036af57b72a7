// q4chat's LineInput without a terminal: lines in order with their numbers, the last line
// without '\n', and a line over the limit is an error naming its number (no endless read).
#include "line_input.h"

#include <gtest/gtest.h>

#include <sstream>
#include <stdexcept>

namespace q4::chat {
namespace {

TEST(LineInput, ReadsLinesAndNumbersThem) {
  std::istringstream in("one\n\ntwo words\nlast");
  LineInput li(in, /*edit=*/false);
  EXPECT_FALSE(li.editing());
  std::string line;
  ASSERT_TRUE(li.next("", line));
  EXPECT_EQ(line, "one");
  ASSERT_TRUE(li.next("", line));
  EXPECT_EQ(line, "");
  ASSERT_TRUE(li.next("", line));
  EXPECT_EQ(line, "two words");
  ASSERT_TRUE(li.next("", line));
  EXPECT_EQ(line, "last");
  EXPECT_EQ(li.line_number(), 4);
  EXPECT_FALSE(li.next("", line));
}

TEST(LineInput, OverlongLineIsAnErrorNamingIt) {
  std::istringstream in("ok\n" + std::string(100, 'x'));
  LineInput li(in, /*edit=*/false, /*max_bytes=*/64);
  std::string line;
  ASSERT_TRUE(li.next("", line));
  try {
    li.next("", line);
    FAIL() << "no error";
  } catch (const std::length_error& e) {
    EXPECT_NE(std::string(e.what()).find("stdin line 2: longer than 64 bytes"), std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace q4::chat
