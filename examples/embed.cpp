// How a storage service embeds xDFS: serve a directory and copy a file through it, in one
// process. Usage: embed DIR FILE  (uploads FILE into DIR through a server on loopback, 4 channels)
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>

#include "xdfs/client.hpp"
#include "xdfs/server.hpp"
#include "xdfs/xsec.hpp"
#include "xdfs/xdfs.hpp"

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: embed DIR FILE\n");
    return 2;
  }
  try {
    // Every channel is authenticated: this process's client key (made on first use) is the one
    // key its own server admits. The server keeps its identity in a private state directory.
    char tmpl[] = "/tmp/xdfs-embed-XXXXXX";
    const std::string state = ::mkdtemp(tmpl);
    auto me = xdfs::xsec::load_or_create_key(xdfs::xsec::default_config_dir() + "/id_x25519");
    std::ofstream(state + "/authorized_keys") << xdfs::xsec::format_public(me.public_key) << " rw\n";
    xdfs::ServerConfig cfg;
    cfg.root = argv[1];
    cfg.state_dir = state;
    cfg.listen = "127.0.0.1:0";
    cfg.log = [](const std::string&) {};  // a service would hand these to its own logger
    xdfs::Server server(cfg, xdfs::runtime::session_factory(xdfs::standard_modes()));
    std::thread listener([&] { server.run(); });

    xdfs::TransferOptions opt;
    opt.channels = 4;
    auto r = xdfs::upload(argv[2], {"127.0.0.1", server.port()}, "", opt);
    std::printf("uploaded %llu bytes in %.3f s over %u channels\n", static_cast<unsigned long long>(r.bytes), r.seconds,
                r.channels);
    server.stop();
    listener.join();
    std::filesystem::remove_all(state);
  } catch (const xdfs::Error& e) {
    std::fprintf(stderr, "embed: %s\n", e.what());
    return 1;
  }
  return 0;
}
