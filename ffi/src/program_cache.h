// The CUDA executor's program cache (cuda_executor.cu): GPU programs and their staging scratch, kept
// per call site, bounded by call sites (least recently used first out), released only once their
// work completed. Plain C++ (no CUDA headers) so CI tests the eviction logic without a GPU
// (tests/native/test_gpu_program.py through jax_blink._native._gpusim.program_cache_trace).
//
// Why deferred release: an evicted program's last call may still run on the GPU (its ops read the
// scratch, its CUDA graphs may be launched), and the host returns from a call long before the
// streams finish. So eviction only moves a program to the retired list; Collect frees a retired
// program when `done` says its work completed (the CUDA layer asks the events recorded on the XLA
// streams after the program's latest call). A retired program is never issued again, so its latest
// call stays its last.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <list>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace jax_blink {

// Call sites kept: JAX_BLINK_CUDA_CACHE_PROGRAMS (`env`: its value or nullptr), default 64, valid
// 1..1000000 (anything else: the default).
inline size_t ProgramCacheCapacity(const char* env) {
  constexpr size_t kDefault = 64;
  if (!env || !*env) return kDefault;
  char* end = nullptr;
  const long long v = std::strtoll(env, &end, 10);
  if (*end != '\0' || v < 1 || v > 1000000) return kDefault;
  return static_cast<size_t>(v);
}

template <typename V>
class ProgramCache {
 public:
  explicit ProgramCache(size_t max_sites) : max_sites_(max_sites < 1 ? 1 : max_sites) {}

  // The program under (site, key), or nullptr. A hit makes `site` the most recently used.
  std::shared_ptr<V> Find(int64_t site, const std::string& key) {
    auto it = sites_.find(site);
    if (it == sites_.end()) return nullptr;
    auto p = it->second.programs.find(key);
    if (p == it->second.programs.end()) return nullptr;
    lru_.splice(lru_.begin(), lru_, it->second.pos);
    return p->second;
  }

  // Adds `v` under (site, key) (replacing an entry there, which is retired) and makes `site` the most
  // recently used; then retires every program of the least recently used sites beyond the bound
  // (never `site` itself).
  void Insert(int64_t site, const std::string& key, std::shared_ptr<V> v) {
    auto it = sites_.find(site);
    if (it == sites_.end()) {
      lru_.push_front(site);
      it = sites_.emplace(site, Site{lru_.begin(), {}}).first;
    } else {
      lru_.splice(lru_.begin(), lru_, it->second.pos);
    }
    auto& slot = it->second.programs[key];
    if (slot) retired_.push_back(std::move(slot));
    slot = std::move(v);
    while (sites_.size() > max_sites_) {
      const int64_t victim = lru_.back();
      lru_.pop_back();
      auto vit = sites_.find(victim);
      for (auto& [k, prog] : vit->second.programs) retired_.push_back(std::move(prog));
      sites_.erase(vit);
      ++evicted_sites_;
    }
  }

  // Releases the retired programs whose work completed: for each, if done(v) then release(v) and
  // the entry is dropped; the others stay for a later Collect. Returns how many were released.
  template <class Done, class Release>
  size_t Collect(Done&& done, Release&& release) {
    size_t n = 0;
    for (size_t i = 0; i < retired_.size();) {
      if (done(*retired_[i])) {
        release(*retired_[i]);
        retired_.erase(retired_.begin() + static_cast<std::ptrdiff_t>(i));
        ++n;
      } else {
        ++i;
      }
    }
    return n;
  }

  // Calls f(v) for every program, kept and retired (the executor polls their error records).
  template <class F>
  void ForEach(F&& f) {
    for (auto& [s, site] : sites_)
      for (auto& [k, v] : site.programs) f(*v);
    for (auto& v : retired_) f(*v);
  }

  size_t sites() const { return sites_.size(); }
  size_t retired() const { return retired_.size(); }
  size_t max_sites() const { return max_sites_; }
  int64_t evicted_sites() const { return evicted_sites_; }
  size_t programs() const {
    size_t n = 0;
    for (auto& [s, site] : sites_) n += site.programs.size();
    return n;
  }

 private:
  struct Site {
    std::list<int64_t>::iterator pos;  // in lru_
    std::map<std::string, std::shared_ptr<V>> programs;
  };
  size_t max_sites_;
  std::list<int64_t> lru_;  // most recently used first
  std::map<int64_t, Site> sites_;
  std::vector<std::shared_ptr<V>> retired_;
  int64_t evicted_sites_ = 0;
};

}  // namespace jax_blink
