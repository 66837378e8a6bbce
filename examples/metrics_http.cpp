#include "metrics_http.hpp"

#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <boost/asio/steady_timer.hpp>
#include <fmt/core.h>

#include <thread>

#include "xdfs/error.hpp"
#include "xdfs/xdsi.hpp"

namespace xdfs::cli {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = asio::ip::tcp;

namespace {

constexpr unsigned max_connections = 16;

struct Connection : std::enable_shared_from_this<Connection> {
  Connection(tcp::socket s, const std::function<std::string()>& render, unsigned& open)
      : stream(std::move(s)), render(render), open(open) {
    ++open;
  }
  ~Connection() { --open; }

  void start() {
    parser.header_limit(8 * 1024);
    parser.body_limit(0);
    stream.expires_after(std::chrono::seconds(5));
    http::async_read(stream, buffer, parser, [self = shared_from_this()](beast::error_code ec, std::size_t) {
      if (!ec) self->answer();
    });
  }

  void answer() {
    const auto& req = parser.get();
    auto res = std::make_shared<http::response<http::string_body>>();
    res->version(req.version());
    res->keep_alive(false);
    res->set(http::field::server, "xdfsd");
    if (req.method() != http::verb::get && req.method() != http::verb::head) {
      res->result(http::status::method_not_allowed);
      res->set(http::field::allow, "GET, HEAD");
    } else if (req.target() != "/metrics") {
      res->result(http::status::not_found);
      res->body() = "not found: the counters are at /metrics\n";
    } else {
      res->result(http::status::ok);
      res->set(http::field::content_type, "text/plain; version=0.0.4; charset=utf-8");
      if (req.method() == http::verb::get) res->body() = render();
    }
    res->prepare_payload();
    stream.expires_after(std::chrono::seconds(5));
    http::async_write(stream, *res, [self = shared_from_this(), res](beast::error_code, std::size_t) {
      beast::error_code ignored;
      self->stream.socket().shutdown(tcp::socket::shutdown_send, ignored);
    });
  }

  beast::tcp_stream stream;
  beast::flat_buffer buffer{8 * 1024};
  http::request_parser<http::empty_body> parser;
  const std::function<std::string()>& render;
  unsigned& open;
};

}  // namespace

struct MetricsEndpoint::Impl {
  // Before the loop: its destructor destroys pending handlers, whose connections refer to these.
  std::function<std::string()> render;
  unsigned open = 0;  // loop thread only
  asio::io_context io{1};
  tcp::acceptor acceptor{io};
  asio::steady_timer retry{io};
  std::string where;  // HOST:PORT as bound (before the loop's thread starts)
  std::thread thread;

  void accept() {
    if (open >= max_connections) {  // the rest wait in the backlog; look again shortly
      retry.expires_after(std::chrono::milliseconds(50));
      retry.async_wait([this](const beast::error_code& ec) {
        if (!ec) accept();
      });
      return;
    }
    acceptor.async_accept([this](beast::error_code ec, tcp::socket s) {
      if (ec == asio::error::operation_aborted) return;
      if (!ec) std::make_shared<Connection>(std::move(s), render, open)->start();
      if (ec) {  // out of descriptors and the like: do not spin
        retry.expires_after(std::chrono::milliseconds(100));
        retry.async_wait([this](const beast::error_code& e) {
          if (!e) accept();
        });
        return;
      }
      accept();
    });
  }
};

MetricsEndpoint::MetricsEndpoint(const std::string& host_port, std::function<std::string()> render)
    : impl_(std::make_unique<Impl>()) {
  impl_->render = std::move(render);
  std::string host;
  std::uint16_t port = 0;
  if (!xdsi::parse_host_port(host_port, 0, host, port) || host_port.find_last_of(':') == std::string::npos ||
      host_port.back() == ']')
    throw Error(errc::bad_argument, "--metrics '" + host_port + "' is not HOST:PORT");
  beast::error_code ec;
  const auto addr = asio::ip::make_address(host, ec);
  if (ec) throw Error(errc::bad_argument, "--metrics takes an IP address and a port, not '" + host_port + "'");
  const tcp::endpoint ep(addr, port);
  auto& a = impl_->acceptor;
  a.open(ep.protocol(), ec);
  if (!ec) a.set_option(asio::socket_base::reuse_address(true), ec);
  if (!ec) a.bind(ep, ec);
  if (!ec) a.listen(asio::socket_base::max_listen_connections, ec);
  if (ec) throw Error(errc::bad_argument, "--metrics " + host_port + ": " + ec.message());
  impl_->where = ep.address().is_v6() ? fmt::format("[{}]:{}", ep.address().to_string(), a.local_endpoint().port())
                                      : fmt::format("{}:{}", ep.address().to_string(), a.local_endpoint().port());
  impl_->accept();
  impl_->thread = std::thread([d = impl_.get()] {
    for (;;) {
      try {
        d->io.run();
        return;
      } catch (const std::exception&) {
        // One scrape's failure is that scrape's; the endpoint goes on.
      }
    }
  });
}

MetricsEndpoint::~MetricsEndpoint() {
  impl_->io.stop();
  if (impl_->thread.joinable()) impl_->thread.join();
}

std::string MetricsEndpoint::where() const { return impl_->where; }

}  // namespace xdfs::cli
