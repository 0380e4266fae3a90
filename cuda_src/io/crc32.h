// crc32.h — CRC-32 with zlib's polynomial (reflected 0xEDB88320), so Python's zlib.crc32 over a
// file's bytes gives the same value the binary records in run.toml.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace attnstep {

// Continues a CRC over more bytes: crc32_update(crc32_update(0, a), b) == CRC of a+b.
uint32_t crc32_update(uint32_t crc, const void* data, size_t len);

// "xxxxxxxx", lower-case hex, as run.toml stores it.
std::string crc32_hex(uint32_t crc);

}  // namespace attnstep
