// One core's read rate (GB/s): `read_rate sweep MB` sums a buffer of MB megabytes over and over (after a
// warm-up sweep it sits in whichever cache level holds it); `read_rate chunks BYTES` sums chunks of BYTES
// contiguous bytes at random places of a 1 GB buffer, two at a time side by side, each chunk once (the
// access pattern of paged attention: a key block and its value block per tile). Prints the best of
// `rounds` rounds. Built by benchmarks/benchmark_read_rate.py.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

// 64-byte vectors (one zmm on AVX-512, two ymm on AVX2): few instructions per line, so the core's
// out-of-order window holds many lines' loads at once, as a read-bound loop's should.
typedef uint64_t Line __attribute__((vector_size(64)));

static uint64_t total(Line v) {
  uint64_t t = 0;
  for (int i = 0; i < 8; ++i) t += v[i];
  return t;
}

static uint64_t sum_pair(const uint64_t* p, const uint64_t* q, size_t words) {
  const Line* a = reinterpret_cast<const Line*>(p);
  const Line* b = reinterpret_cast<const Line*>(q);
  Line x = {}, y = {};
  for (size_t i = 0; i < words / 8; ++i) {
    x += a[i];
    y += b[i];
  }
  return total(x + y);
}

static uint64_t sum_range(const uint64_t* p, size_t words) {
  const Line* a = reinterpret_cast<const Line*>(p);
  Line x = {}, y = {};
  for (size_t i = 0; i < words / 8; i += 2) {
    x += a[i];
    y += a[i + 1];
  }
  return total(x + y);
}

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: read_rate sweep MB | chunks BYTES [rounds]\n");
    return 2;
  }
  const bool sweep = std::strcmp(argv[1], "sweep") == 0;
  const size_t arg = std::strtoull(argv[2], nullptr, 10);
  const int rounds = argc > 3 ? std::atoi(argv[3]) : 5;
  const size_t bytes = sweep ? arg << 20 : size_t{1} << 30, chunk = sweep ? bytes : arg;
  // 64-byte aligned, so that every Line load is one cache line.
  uint64_t* buf = static_cast<uint64_t*>(std::aligned_alloc(64, bytes));
  std::iota(buf, buf + bytes / 8, uint64_t{1});  // every page touched: no first-touch faults timed
  const size_t chunks = bytes / chunk;
  std::vector<size_t> order(chunks);
  std::iota(order.begin(), order.end(), size_t{0});
  std::shuffle(order.begin(), order.end(), std::mt19937_64(1));
  // A sweep reads its buffer until ~2 GB have passed; the chunks, 256 MB of them (a fresh set a round).
  const size_t per_round = sweep ? std::max<size_t>(1, (size_t{2} << 30) / bytes) : (size_t{256} << 20) / chunk;
  double best = 0;
  uint64_t sink = sum_range(buf, bytes / 8);
  for (int r = 0; r < rounds; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    for (size_t i = 0; i < per_round; i += sweep ? 1 : 2) {
      if (sweep) {
        sink += sum_range(buf, bytes / 8);
      } else {
        const size_t c0 = order[(r * per_round + i) % chunks], c1 = order[(r * per_round + i + 1) % chunks];
        sink += sum_pair(buf + c0 * chunk / 8, buf + c1 * chunk / 8, chunk / 8);
      }
    }
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = std::max(best, per_round * chunk / s / 1e9);
  }
  std::printf("%.2f %llu\n", best, static_cast<unsigned long long>(sink & 1));
  std::free(buf);
  return 0;
}
