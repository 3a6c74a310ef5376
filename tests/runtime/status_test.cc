#include "runtime/base/status.h"

#include <cerrno>

#include <gtest/gtest.h>

#include "runtime/base/check.h"
#include "runtime/base/units.h"
#include "tests/test_util.h"

namespace strata {
namespace {

TEST(Status, OkAndCodes) {
  EXPECT_TRUE(Status::Ok().ok());
  Status s = DataLoss("block 3 checksum mismatch");
  EXPECT_FALSE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kDataLoss);
  EXPECT_EQ(s.ToString(), "DATA_LOSS: block 3 checksum mismatch");
  EXPECT_EQ(s.WithContext("swap-in").ToString(), "DATA_LOSS: swap-in: block 3 checksum mismatch");
}

TEST(Status, ErrnoMapping) {
  struct Case {
    int err;
    StatusCode code;
  } cases[] = {{ENOSPC, StatusCode::kResourceExhausted}, {EDQUOT, StatusCode::kResourceExhausted},
               {EIO, StatusCode::kIoError},              {ENOENT, StatusCode::kNotFound},
               {EACCES, StatusCode::kPermissionDenied},  {EROFS, StatusCode::kPermissionDenied},
               {EAGAIN, StatusCode::kUnavailable},       {EINVAL, StatusCode::kInvalidArgument},
               {ETIMEDOUT, StatusCode::kDeadlineExceeded}};
  for (const auto& c : cases) {
    Status s = ErrnoToStatus(c.err, "pwrite /x");
    EXPECT_EQ(s.code(), c.code) << c.err;
    EXPECT_EQ(s.sys_errno(), c.err);
    EXPECT_NE(s.message().find("pwrite /x: "), std::string::npos);
  }
  EXPECT_NE(ErrnoToStatus(ENOSPC, "w").message().find("free space"), std::string::npos);
}

StatusOr<int> Half(int x) {
  STRATA_CHECK(x % 2 == 0, "x=", x, ": must be even");
  return x / 2;
}

StatusOr<int> Quarter(int x) {
  STRATA_ASSIGN_OR_RETURN(int h, Half(x));
  STRATA_ASSIGN_OR_RETURN(int q, Half(h));
  return q;
}

TEST(Status, MacrosPropagate) {
  ASSERT_OK_AND_ASSIGN(int q, Quarter(8));
  EXPECT_EQ(q, 2);
  auto bad = Quarter(6);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(bad.status().message(), "x=3: must be even");
}

TEST(StatusDeathTest, DcheckAborts) {
  EXPECT_DEATH({ STRATA_DCHECK(1 + 1 == 3, "arithmetic"); }, "invariant failed: 1 \\+ 1 == 3");
  StatusOr<int> s = NotFound("nope");
  EXPECT_DEATH({ (void)s.value(); }, "NOT_FOUND: nope");
}

TEST(Units, ParseBytes) {
  struct Case {
    const char* text;
    uint64_t bytes;
  } ok[] = {{"4096", 4096},           {"5e8", 500000000},      {"64KiB", 65536},
            {"8MiB", 8 << 20},        {"2GiB", 2ull << 30},    {"1.5GiB", 3ull << 29},
            {"10MB", 10000000},       {"2 gb", 2000000000},    {"512k", 512 << 10},
            {"1TiB", 1ull << 40},     {"0", 0}};
  for (const auto& c : ok) {
    auto r = ParseBytes(c.text);
    ASSERT_TRUE(r.ok()) << c.text << ": " << r.status();
    EXPECT_EQ(*r, c.bytes) << c.text;
  }
  for (const char* bad : {"", "-1", "abc", "1.5", "3XB", "1e30", "GiB"}) {
    auto r = ParseBytes(bad);
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_NE(r.status().message().find("is not a byte size"), std::string::npos);
  }
  EXPECT_EQ(FormatBytes(512), "512 B");
  EXPECT_EQ(FormatBytes(3ull << 29), "1.50 GiB");
}

}  // namespace
}  // namespace strata
