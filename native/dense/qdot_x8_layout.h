// Where each byte of a plain Q4_K / Q5_K / Q6_K super-block (MXFP4, Q8_0 block) goes in the
// interleaved layouts of qdot.h (Q4_K_X8, Q5_K_X8, Q6_K_X8, MXFP4_X8, Q8_0_X8): one table of
// segments per type, shared by the scalar kernels (which gather each row back) and by qinterleave
// (which builds the layout at load).
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

#include "qdot.h"
#include "qdot_common.h"

namespace ftdense {

// `len` bytes at `row` of row r's super-block sit at `group + stride * r` of its group's.
struct X8Segment {
  int row, group, stride, len;
};

inline const std::vector<X8Segment>& x8_segments(QType base) {
  static const std::vector<X8Segment> q4k = [] {
    std::vector<X8Segment> s = {{0, 0, 2, 2}, {2, 16, 2, 2}};
    for (int w = 0; w < 3; ++w) s.push_back({4 + 4 * w, 32 + 32 * w, 4, 4});
    for (int c = 0; c < 4; ++c)
      for (int i4 = 0; i4 < 8; ++i4) s.push_back({16 + 32 * c + 4 * i4, 128 + 32 * (4 * i4 + c), 4, 4});
    return s;
  }();
  static const std::vector<X8Segment> q6k = [] {
    std::vector<X8Segment> s = {{208, 0, 2, 2}};
    for (int v = 0; v < 4; ++v) s.push_back({192 + 4 * v, 16 + 32 * v, 4, 4});
    for (int h = 0; h < 2; ++h)
      for (int i4 = 0; i4 < 8; ++i4) {
        const int at = 144 + 96 * (8 * h + i4);
        s.push_back({64 * h + 4 * i4, at, 4, 4});
        s.push_back({64 * h + 32 + 4 * i4, at + 32, 4, 4});
        s.push_back({128 + 32 * h + 4 * i4, at + 64, 4, 4});
      }
    return s;
  }();
  static const std::vector<X8Segment> mxfp4 = [] {  // a block of 32 inputs
    std::vector<X8Segment> s = {{0, 0, 1, 1}};
    for (int c = 0; c < 4; ++c) s.push_back({1 + 4 * c, 8 + 32 * c, 4, 4});
    return s;
  }();
  static const std::vector<X8Segment> q5k = [] {  // Q4_K's, with qh words before the nibbles
    std::vector<X8Segment> s = {{0, 0, 2, 2}, {2, 16, 2, 2}};
    for (int w = 0; w < 3; ++w) s.push_back({4 + 4 * w, 32 + 32 * w, 4, 4});
    for (int i4 = 0; i4 < 8; ++i4) s.push_back({16 + 4 * i4, 128 + 32 * i4, 4, 4});
    for (int c = 0; c < 4; ++c)
      for (int i4 = 0; i4 < 8; ++i4)
        s.push_back({48 + 32 * c + 4 * i4, 384 + 32 * (4 * i4 + c), 4, 4});
    return s;
  }();
  static const std::vector<X8Segment> q8_0 = [] {  // a block of 32 inputs
    std::vector<X8Segment> s = {{0, 0, 2, 2}};
    for (int c = 0; c < 8; ++c) s.push_back({2 + 4 * c, 16 + 32 * c, 4, 4});
    return s;
  }();
  return base == QType::Q4_K   ? q4k
         : base == QType::Q6_K ? q6k
         : base == QType::Q8_0 ? q8_0
         : base == QType::Q5_K ? q5k
                               : mxfp4;
}

// A row's inputs and bytes in one unit of the interleaved layout: the type's block (a Q4_K /
// Q5_K / Q6_K super-block, an MXFP4 / Q8_0 block); a group's unit is 8 times the bytes.
inline int x8_block_inputs(QType base) { return qblock_inputs(base); }
inline int x8_block_bytes(QType base) {
  return static_cast<int>(qrow_bytes(base, qblock_inputs(base)));
}

// Row r's plain super-block from its group's interleaved one.
inline void x8_gather(QType base, const uint8_t* group, int r, uint8_t* row) {
  for (const X8Segment& s : x8_segments(base))
    std::memcpy(row + s.row, group + s.group + s.stride * r, static_cast<size_t>(s.len));
}

// Row r's plain super-block into its group's interleaved one.
inline void x8_scatter(QType base, const uint8_t* row, int r, uint8_t* group) {
  for (const X8Segment& s : x8_segments(base))
    std::memcpy(group + s.group + s.stride * r, row + s.row, static_cast<size_t>(s.len));
}

}  // namespace ftdense
