// The Java callers of Leaf's HTTP API the drop-in tests run (dispenser_lab.leaf.callers): Spring's RestTemplate
// asked for a Long (Jackson on the class path: it sends "Accept: application/json, application/*+json") and
// for a String, and Java's own HttpClient reading the body as text. Prints one JSON line; a caller that
// fails prints its exception instead of a value. One object per URL given, on one line each.
import java.net.URI;
import java.net.http.HttpClient;
import java.net.http.HttpRequest;
import java.net.http.HttpResponse;
import org.springframework.web.client.RestTemplate;

public class Callers {
    public static void main(String[] args) throws Exception {
        for (String url : args) {
            System.out.println(ask(url));
        }
    }

    private static String ask(String url) throws Exception {
        RestTemplate rest = new RestTemplate();
        StringBuilder out = new StringBuilder("{");
        try {
            Long id = rest.getForObject(url, Long.class);
            out.append("\"rest_long\": ").append(id);
        } catch (RuntimeException e) {
            out.append("\"rest_long_error\": ").append(quote(e.getClass().getName() + ": " + e.getMessage()));
        }
        String text = rest.getForObject(url, String.class);
        out.append(", \"rest_string\": ").append(quote(text));
        HttpResponse<String> plain = HttpClient.newHttpClient().send(
            HttpRequest.newBuilder(URI.create(url)).build(), HttpResponse.BodyHandlers.ofString());
        out.append(", \"http_client\": ").append(Long.parseLong(plain.body()));
        out.append(", \"http_client_status\": ").append(plain.statusCode()).append("}");
        return out.toString();
    }

    private static String quote(String text) {
        return "\"" + text.replace("\\", "\\\\").replace("\"", "\\\"").replace("\n", " ") + "\"";
    }
}
