// Links every layer through the installed package: a server on a free port and an upload.
#include <xdfs/client.hpp>
#include <xdfs/server.hpp>
#include <xdfs/xftsm/server_mode.hpp>

#include <cstdio>
#include <thread>

int main(int argc, char** argv) {
  if (argc != 3) return 2;
  xdfs::ServerConfig cfg;
  cfg.root = argv[1];
  cfg.listen = "127.0.0.1:0";
  cfg.log = [](const std::string&) {};
  xdfs::Server server(cfg, xdfs::xftsm::server_factory());
  std::thread t([&] { server.run(); });
  auto r = xdfs::upload(argv[2], {"127.0.0.1", server.port()}, "copy", {});
  server.stop();
  t.join();
  std::printf("consumer moved %llu bytes\n", static_cast<unsigned long long>(r.bytes));
  return 0;
}
