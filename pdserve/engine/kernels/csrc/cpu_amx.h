// What the AMX kernels (cpu_amx_linear.cpp, cpu_amx_prefill.cpp) share.
#pragma once

#include <cstdint>

namespace pds {

// Whether this process may use AMX bf16 tiles: the CPU has them and Linux granted the tile state
// (defined in cpu_amx_linear.cpp).
bool amx_ready();

// LDTILECFG's 64-byte operand (palette 1): rows and bytes per row of each of the 8 tiles.
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// The configuration both kernels use: all 8 tiles at their full 16 rows x 64 bytes.
inline TileConfig full_tiles() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = 16;
    config.colsb[t] = 64;
  }
  return config;
}

}  // namespace pds
