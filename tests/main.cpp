// The test runner. Every test talks xSec, so before any test runs this makes a throw-away
// client identity and server state directory, authorizes that client, and points the
// defaults (and every spawned xdfsd and xduc) at them through the environment.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "xdfs/xsec.hpp"

int main(int argc, char** argv) {
  char tmpl[] = "/tmp/xdfs-keys-XXXXXX";
  const std::string base = ::mkdtemp(tmpl);
  const std::string config = base + "/config";
  const std::string state = base + "/state";
  ::setenv("XDFS_CONFIG_DIR", config.c_str(), 1);
  ::setenv("XDFS_STATE_DIR", state.c_str(), 1);
  auto client = xdfs::xsec::load_or_create_key(config + "/id_x25519");
  std::filesystem::create_directories(state);
  // One server identity for every test server, made now: a test that runs a server with a state
  // directory of its own copies it, so that no client pins two keys for one loopback port.
  (void)xdfs::xsec::load_or_create_key(state + "/server_x25519");
  std::ofstream(state + "/authorized_keys") << xdfs::xsec::format_public(client.public_key) << " rw  # the tests\n";

  doctest::Context ctx(argc, argv);
  const int rc = ctx.run();
  std::error_code ec;
  std::filesystem::remove_all(base, ec);
  return rc;
}
