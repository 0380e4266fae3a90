// crc32.cpp — table-driven CRC-32 (one byte per step; output files are written at disk speed,
// so a slicing-by-8 variant would not show).
#include "crc32.h"

#include <array>
#include <cstdio>

namespace attnstep {

namespace {

std::array<uint32_t, 256> make_table() {
    std::array<uint32_t, 256> t{};
    for (uint32_t n = 0; n < 256; ++n) {
        uint32_t c = n;
        for (int k = 0; k < 8; ++k) c = (c & 1u) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
        t[n] = c;
    }
    return t;
}

}  // namespace

uint32_t crc32_update(uint32_t crc, const void* data, size_t len) {
    static const std::array<uint32_t, 256> table = make_table();
    const unsigned char* p = static_cast<const unsigned char*>(data);
    crc = ~crc;  // zlib's pre- and post-inversion
    for (size_t i = 0; i < len; ++i) crc = table[(crc ^ p[i]) & 0xFFu] ^ (crc >> 8);
    return ~crc;
}

std::string crc32_hex(uint32_t crc) {
    char buf[9];
    std::snprintf(buf, sizeof buf, "%08x", crc);
    return buf;
}

}  // namespace attnstep
